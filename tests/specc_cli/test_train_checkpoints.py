"""`specc train` and checkpoints from the command line: `--keep-last K` prunes old checkpoints,
`--max-restarts R` survives a killed rank by restarting from the last checkpoint (the same losses
and weights as a run nobody killed), and `--load` of a `specc hf import` checkpoint trains from
its weights with a fresh optimizer."""

from __future__ import annotations

import json
import os
import sys

import pytest

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
GPT_TINY = os.path.join(ROOT, "specs", "gpt-tiny.yaml")
SMALL = ("--micro-batch-size", "2", "--global-batch-size", "4", "--eval-iters", "0", "--log-interval", "1",
         "--no-progress")


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    from runtime.data import prepare, stdlib_files

    out = str(tmp_path_factory.mktemp("ckpt_cli") / "corpus")
    prepare(stdlib_files(limit=8), "byte", out)
    return out


def _train_records(run_dir) -> list:
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [r for r in map(json.loads, f) if r["kind"] == "train"]


def test_keep_last_keeps_the_newest_checkpoints(specc, corpus, tmp_path):
    from runtime.checkpoint import complete_steps, latest_step

    ckpt = tmp_path / "ckpt"
    code, out, err = specc("train", GPT_TINY, "--train-iters", "5", "--save", ckpt, "--save-interval", "1",
                           "--keep-last", "2", "--data-path", corpus, "--run-dir", tmp_path / "run", *SMALL)
    assert code == 0, out + err
    assert out.count("saved checkpoint") == 5  # five saves, the last two kept
    assert complete_steps(str(ckpt)) == [4, 5] and latest_step(str(ckpt)) == 5
    assert sorted(os.listdir(ckpt)) == ["latest", "run.lock", "step_0000004", "step_0000005"]  # nothing half-deleted (run.lock: the run's lock)

    for flags, message in ((("--save", ckpt, "--keep-last", "0"), "error: --keep-last must be at least 1, got 0"),
                           (("--keep-last", "2"), "error: --keep-last needs --save DIR"),
                           (("--max-restarts", "-1"), "error: --max-restarts must be at least 0, got -1")):
        code, _, err = specc("train", GPT_TINY, *flags, "--data-path", corpus, "--run-dir", tmp_path / "never")
        assert (code, err) == (2, message + "\n")
    assert complete_steps(str(ckpt)) == [4, 5] and not (tmp_path / "never").exists()

    # `torchrun -m specc_cli.rank` takes the same flag
    from specc_cli.train_args import build_rank_parser
    from specc_cli.train_config import config_from_args

    args = build_rank_parser().parse_args([GPT_TINY, "--save", str(ckpt), "--keep-last", "3"])
    assert config_from_args(args).checkpoint.keep_last == 3


def test_max_restarts_resumes_a_killed_rank_from_the_last_checkpoint(specc, corpus, tmp_path, monkeypatch,
                                                                     ranks_on_gloo):
    """The rank killed is rank 0, the one that writes metrics.jsonl: it flushes only every
    --log-interval (100 here), so what it buffered dies with it. Every checkpoint flushes it
    first, so the restarted run (which drops the lines after the checkpoint) ends up with every
    iteration exactly once. The run nobody killed, the reference, trains its 2 ranks on the
    session's gloo pool (tests/specc_cli/gloo_launch.py): the same command, without a second
    torchrun launch's process starts."""
    import torch

    from runtime.checkpoint import complete_steps, latest_step, read_tensors

    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    # TP=2 + SP with dropout: the resumed run must also restore every rank's RNG streams
    flags = ("--nproc-per-node", "2", "--tp", "2", "--sp", "--set", "hidden_dropout=0.1", "--train-iters", "6",
             "--save-interval", "2", "--keep-last", "2", "--data-path", corpus)
    monkeypatch.setenv("SPECC_TEST_KILL_AT_ITER", "4")  # rank 0 SIGKILLs itself before iteration 4, once
    monkeypatch.setenv("SPECC_TEST_KILL_RANK", "0")
    buffered = (*SMALL[:6], "--log-interval", "100", *SMALL[8:])  # (a flag given twice is an error)
    code, out, err = specc("train", GPT_TINY, *flags, *buffered, "--max-restarts", "1", "--save", tmp_path / "b",
                           "--run-dir", tmp_path / "b")
    assert code == 0, out + err[-3000:]
    assert "launching 2 ranks: torchrun --nproc-per-node 2 --nnodes 1 --max-restarts 1 -m specc_torch.train" in err
    assert "exitcode: -9" in err  # torchrun saw rank 0 die of SIGKILL
    assert f"elastic restart 1: resuming from {tmp_path / 'b'}" in out
    assert f"loaded checkpoint {tmp_path / 'b' / 'step_0000002'} at iteration 2" in out
    killed = [(r["iteration"], r["loss"]) for r in _train_records(tmp_path / "b")]

    monkeypatch.delenv("SPECC_TEST_KILL_AT_ITER")
    monkeypatch.delenv("SPECC_TEST_KILL_RANK")
    launched = ranks_on_gloo()
    code, out, err = specc("train", GPT_TINY, *flags, *SMALL, "--save", tmp_path / "a", "--run-dir", tmp_path / "a")
    assert code == 0, out + err
    assert len(launched) == 1 and "launching 2 ranks: torchrun --nproc-per-node 2 --nnodes 1 -m specc_torch.train" in err
    straight = [(r["iteration"], r["loss"]) for r in _train_records(tmp_path / "a")]
    assert [i for i, _ in straight] == [1, 2, 3, 4, 5, 6]
    # iterations 1-2 of the first attempt (flushed by the checkpoint of iteration 2), then 3-6
    # from that checkpoint: each once (the first attempt's iteration 3 died in rank 0's buffer),
    # bit-identical, dropout included
    assert killed == straight
    assert latest_step(str(tmp_path / "b")) == 6 and complete_steps(str(tmp_path / "b")) == [4, 6]
    # and the same weights at the end, bit for bit
    a, b = read_tensors(str(tmp_path / "a"), step=6), read_tensors(str(tmp_path / "b"), step=6)
    assert a.keys() == b.keys() and a
    assert [name for name in a if not torch.equal(a[name], b[name])] == []


def test_one_rank_with_max_restarts_is_launched_under_torchrun(specc, corpus, tmp_path, monkeypatch):
    """Only torchrun's agent restarts a rank: with --max-restarts even one rank goes through it
    (without, one rank trains in the launcher's own process). The launch itself is exercised by
    the test above."""
    import subprocess

    launched = []
    monkeypatch.setattr(subprocess, "call", lambda cmd, env: launched.append(cmd) or 0)
    code, out, err = specc("train", GPT_TINY, "--nproc-per-node", "1", "--max-restarts", "1", "--train-iters", "1",
                           "--data-path", corpus, "--run-dir", tmp_path / "run", *SMALL)
    assert code == 0, out + err
    assert "launching 1 rank: torchrun --nproc-per-node 1 --nnodes 1 --max-restarts 1 -m specc_torch.train" in err
    (cmd,) = launched
    assert cmd[1:3] == ["-m", "specc_torch.torchrun"] and cmd[cmd.index("--max-restarts") + 1] == "1"
    assert not (tmp_path / "run" / "metrics.jsonl").exists()  # nothing trained here


def _first_batch_hf_loss(hf_model, corpus: str, micro_batch_size: int, micro_batches: int) -> float:
    """The HF model's mean per-token loss on iteration 1's global batch (the loop's data order)."""
    import torch

    from runtime.data import build_datasets
    from runtime.train.config import split_weights

    train = build_datasets(corpus, 32, 1234, split_weights("969,30,1"))["train"]
    losses = []
    with torch.no_grad():
        for m in range(micro_batches):
            tokens, labels = train.micro_batch(0, m, micro_batch_size, 0, 1)
            logits = hf_model(input_ids=torch.from_numpy(tokens)).logits
            losses.append(torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]),
                                                            torch.from_numpy(labels).reshape(-1)))
    return torch.stack(losses).mean().item()


def test_load_of_an_hf_import_trains_from_its_weights_with_a_fresh_optimizer(specc, corpus, tmp_path):
    pytest.importorskip("transformers")
    import torch

    sys.path.insert(0, os.path.join(ROOT, "tests", "specc_torch", "hf"))
    from hf_helpers import save_hf

    from runtime.checkpoint import read_tensors

    hf_dir, imported = tmp_path / "hf", tmp_path / "imported"
    model = save_hf("gpt", str(hf_dir), seed=7)
    code, _, err = specc("hf", "import", hf_dir, "--spec", GPT_TINY, "--out", imported)
    assert code == 0, err

    run_dir = tmp_path / "run"
    code, out, err = specc("train", GPT_TINY, "--load", imported, "--train-iters", "2", "--data-path", corpus,
                           "--run-dir", run_dir, *SMALL)
    assert code == 0, out + err
    assert out.count("training starts at iteration 0 with a fresh optimizer") == 1
    records = _train_records(run_dir)
    assert [r["iteration"] for r in records] == [1, 2] and records[0]["consumed_samples"] == 4
    assert records[0]["loss"] == pytest.approx(_first_batch_hf_loss(model, corpus, 2, 2), abs=1e-4)

    # bf16: the optimizer's fp32 master weights start from the loaded weights too (with a
    # vanishing learning rate, a step leaves the imported weights, rounded to bf16, in place)
    saved = tmp_path / "bf16"
    code, out, err = specc("train", GPT_TINY, "--load", imported, "--bf16", "--lr", "1e-12", "--train-iters", "1",
                           "--save", saved, "--data-path", corpus, "--run-dir", tmp_path / "run_bf16", *SMALL)
    assert code == 0, out + err
    before, after = read_tensors(str(imported)), read_tensors(str(saved))
    assert before.keys() == after.keys()
    for name in before:
        assert after[name].dtype == torch.bfloat16
        torch.testing.assert_close(after[name].float(), before[name].to(torch.bfloat16).float(), rtol=0, atol=1e-6,
                                   msg=lambda m, n=name: f"{n}: {m}")


def test_load_of_another_spec_version_needs_allow_spec_change(specc, corpus, tmp_path):
    ckpt = tmp_path / "ckpt"
    code, out, err = specc("train", GPT_TINY, "--train-iters", "1", "--save", ckpt, "--data-path", corpus,
                           "--run-dir", tmp_path / "a", *SMALL)
    assert code == 0, out + err
    changed = ("--set", "hidden_dropout=0.1")  # another spec hash, the same names and shapes
    code, out, err = specc("train", GPT_TINY, *changed, "--train-iters", "2", "--load", ckpt, "--data-path", corpus,
                           "--run-dir", tmp_path / "b", *SMALL)
    assert code != 0 and "--allow-spec-change" in err, out + err
    code, out, err = specc("train", GPT_TINY, *changed, "--train-iters", "2", "--load", ckpt, "--allow-spec-change",
                           "--data-path", corpus, "--run-dir", tmp_path / "c", *SMALL)
    assert code == 0, out + err
    assert [r["iteration"] for r in _train_records(tmp_path / "c")] == [2]  # resumed after the saved step 1
