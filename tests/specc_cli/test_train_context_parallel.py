"""Issue 11's acceptance: `specc train` at TP=2 x CP=2 (4 gloo ranks, with sequence parallelism)
trains the tiny GPT, and its checkpoint loads at TP=1 x CP=1 with the same validation loss. The 4
ranks are the session's gloo pool (tests/specc_cli/gloo_launch.py: the command line, launch's
checks and the ranks' entry as `specc train` runs them, without torchrun's process starts)."""

from __future__ import annotations

import json
import os

import pytest

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
GPT_TINY = os.path.join(ROOT, "specs", "gpt-tiny.yaml")
SMALL = ("--micro-batch-size", "2", "--global-batch-size", "4", "--eval-iters", "2", "--log-interval", "1",
         "--no-progress")


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    from runtime.data import prepare, stdlib_files

    out = str(tmp_path_factory.mktemp("cp_cli") / "corpus")
    prepare(stdlib_files(limit=20), "byte", out)  # 20 documents: one for validation
    return out


def _records(run_dir, kind) -> list:
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [r for r in map(json.loads, f) if r["kind"] == kind]


def test_tp2_cp2_trains_and_its_checkpoint_loads_at_tp1_cp1_with_the_same_validation_loss(specc, corpus, tmp_path,
                                                                                          ranks_on_gloo):
    launched = ranks_on_gloo()
    ckpt = tmp_path / "ckpt"
    code, out, err = specc("train", GPT_TINY, "--nproc-per-node", "4", "--tensor-model-parallel-size", "2",
                           "--context-parallel-size", "2", "--sequence-parallel", "--train-iters", "3",
                           "--lr", "3e-3", "--save", ckpt, "--data-path", corpus, "--run-dir", tmp_path / "cp", *SMALL)
    assert code == 0, out + err[-3000:]
    assert len(launched) == 1 and "launching 4 ranks: torchrun --nproc-per-node 4 --nnodes 1 -m specc_torch.train" in err
    assert "TP 2 x CP 2 x DP 1 x PP 1" in out and out.count("consumed samples:") == 3
    trained = _records(tmp_path / "cp", "train")
    assert [r["iteration"] for r in trained] == [1, 2, 3] and trained[-1]["loss"] < trained[0]["loss"]
    (saved,) = _records(tmp_path / "cp", "eval")

    # One process, TP=1 x CP=1: nothing left to train, so it loads and evaluates the same samples.
    code, out, err = specc("train", GPT_TINY, "--load", ckpt, "--train-iters", "3", "--data-path", corpus,
                           "--run-dir", tmp_path / "one", *SMALL)
    assert code == 0, out + err
    assert len(launched) == 1  # one rank: trained in this process
    (line,) = [ln for ln in out.splitlines() if ln.startswith(f"loaded checkpoint {ckpt / 'step_0000003'} at iteration 3")]
    assert "'cp': 2" in line and line.endswith(", resharded)")
    assert "note: the checkpoint's RNG states are not restored at another layout" in out  # said, not silent
    (loaded,) = _records(tmp_path / "one", "eval")
    assert loaded["iteration"] == saved["iteration"] == 3
    # The same weights, per-token losses summed in another order (TP shards, CP chunks): a few
    # float32 roundings of ~1e-7 relative each.
    assert loaded["loss"] == pytest.approx(saved["loss"], rel=1e-5)


def test_the_context_parallel_flags_and_their_errors(specc, corpus, tmp_path):
    from specc_cli.train_args import build_rank_parser
    from specc_cli.train_config import config_from_args
    from specc_torch.train_checks import check

    # `torchrun -m specc_cli.rank` takes the same flags; the spec compiles for the CP size
    args = build_rank_parser().parse_args([GPT_TINY, "--cp", "2", "--cp-comm-type", "all_gather", "--data-path",
                                           corpus, "--run-dir", str(tmp_path / "never")])
    cfg = config_from_args(args)
    spec = check(cfg, world_size=4)
    assert (cfg.parallel.cp, cfg.parallel.cp_comm_type, cfg.parallel.dp) == (2, "all_gather", 2)
    assert spec.config["seq_length"] == 32
    run_dir = tmp_path / "never"
    code, _, err = specc("train", GPT_TINY, "--nproc-per-node", "2", "--context-parallel-size", "2", "--seq-length",
                         "30", "--data-path", corpus, "--run-dir", run_dir)
    assert code == 2 and len(err.strip().splitlines()) == 1 and "not divisible by 2 x context-parallel size 2" in err
    code, _, err = specc("train", GPT_TINY, "--cp-comm-type", "p2p", "--data-path", corpus, "--run-dir", run_dir)
    assert (code, err) == (2, "error: --cp-comm-type has no effect without context parallelism (add "
                              "--context-parallel-size N, or drop --cp-comm-type)\n")
    assert not run_dir.exists()
