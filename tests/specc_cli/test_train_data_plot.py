"""`specc train`, `specc data prepare` and `specc plot` as a user runs them: Megatron's command
line accepted, every broken rule one line and exit 2 before any rank starts, `torchrun -m
specc_torch.train` launched by hand on 4 ranks (TP=2+SP x DP=2), and the loss plot."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
GPT_TINY = os.path.join(ROOT, "specs", "gpt-tiny.yaml")
SEED_FLAGS = ("--tensor-model-parallel-size 2 --sequence-parallel --micro-batch-size 2 --global-batch-size 32 "
              "--num-layers 12 --hidden-size 1024 --num-attention-heads 16 --seq-length 2048 "
              "--use-distributed-optimizer").split()


sys.path.insert(0, os.path.join(ROOT, "tests", "runtime", "data"))
from tokenizer_files import GPT2_VOCAB_SIZE, gpt2_files  # noqa: E402


@pytest.fixture(scope="module")
def gpt2(tmp_path_factory):
    """A Megatron-format dataset prefix tokenized with GPT-2 BPE vocab/merges files, and the
    tokenizer flags that go with it."""
    from runtime.data import build_tokenizer, prepare, stdlib_files

    folder = tmp_path_factory.mktemp("gpt2")
    vocab, merges = gpt2_files(folder)
    prefix = str(folder / "my-corpus_text_document")
    prepare(stdlib_files(limit=20), build_tokenizer("GPT2BPETokenizer", vocab_file=vocab, merge_file=merges), prefix)
    return prefix, ("--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", vocab, "--merge-file", merges)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    from runtime.data import prepare, stdlib_files

    out = str(tmp_path_factory.mktemp("cli") / "corpus")
    prepare(stdlib_files(limit=20), "byte", out)  # 20 documents: one for validation
    return out


def test_command_modules_do_not_import_torch():
    code = ("import sys, specc_cli.main, specc_cli.train, specc_cli.data, specc_cli.plot; "
            "assert 'torch' not in sys.modules and 'numpy' not in sys.modules, 'imported at import time'")
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


def test_megatrons_command_line_is_accepted_with_its_meaning(specc):
    from specc_cli.main import build_parser
    from specc_cli.train_config import config_from_args
    from specc_torch.train_checks import check

    args = build_parser().parse_args(["train", GPT_TINY, "--nproc-per-node", "2", *SEED_FLAGS])
    cfg = config_from_args(args)
    spec = check(cfg, world_size=2)  # the rules, and the spec compiled with the flags
    assert (cfg.parallel.tp, cfg.parallel.sp, cfg.parallel.dp) == (2, True, 1)
    assert (cfg.micro_batch_size, cfg.global_batch_size, cfg.num_micro_batches) == (2, 32, 16)
    assert cfg.optimizer.use_distributed_optimizer
    assert {k: spec.config[k] for k in ("num_layers", "hidden_size", "num_attention_heads", "seq_length")} == {
        "num_layers": 12, "hidden_size": 1024, "num_attention_heads": 16, "seq_length": 2048}
    assert spec.config["ffn_hidden_size"] == 4096 and spec.config["max_position_embeddings"] == 2048  # derived


def test_broken_rules_are_one_line_each_and_nothing_starts(specc, corpus, tmp_path):
    run_dir = str(tmp_path / "never")
    code, out, err = specc("train", GPT_TINY, "--nproc-per-node", "3", "--tp", "2", "--run-dir", run_dir)
    assert code == 2 and err.strip() == ("error: world size 3 is not divisible by TP*CP*PP = 2*1*1 = 2 "
                                         "(world = TP*CP*DP*PP)")
    code, _, err = specc("train", GPT_TINY, "--nproc-per-node", "4", "--tp", "2", "--micro-batch-size", "2",
                         "--global-batch-size", "6", "--lr-decay-style", "linear", "--train-iters", "0",
                         "--run-dir", run_dir)
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 2 and all(ln.startswith("error: ") for ln in lines)
    assert "global batch = micro batch * DP * accumulation steps" in lines[0]
    code, _, err = specc("train", GPT_TINY, "--num-attention-heads", "3", "--run-dir", run_dir)
    assert code == 2 and len(err.strip().splitlines()) == 1 and "error:" in err  # the compiler's located error
    code, _, err = specc("train", GPT_TINY, "--tp", "2", "--sp", "--seq-length", "33", "--nproc-per-node", "2",
                         "--data-path", corpus, "--run-dir", run_dir)
    assert code == 2 and "error:" in err and len(err.strip().splitlines()) == 1
    code, _, err = specc("train", GPT_TINY, "--data-path", str(tmp_path / "none"), "--run-dir", run_dir)
    assert code == 2 and err.strip().startswith("error: --data-path ") and "specc data prepare" in err
    code, _, err = specc("train", GPT_TINY, "--data-path", corpus, "--set", "vocab_size=128", "--run-dir", run_dir)
    assert code == 2 and "vocabulary (256) is larger than the model's vocab_size (128)" in err
    code, _, err = specc("train", str(tmp_path / "missing.yaml"), "--run-dir", run_dir)
    assert code == 2 and err.strip() == f"error: {tmp_path / 'missing.yaml'}: no such spec file"
    assert not os.path.exists(run_dir)


def test_torchrun_by_hand_trains_tp2_sp_dp2_and_plots(specc, gpt2, tmp_path):
    """`torchrun -m specc_cli.rank` launched by hand: each rank parses Megatron's flags itself
    (`specc train` launches the same module with the checked configuration: the pipeline,
    context-, expert-parallel and restart tests run it). The seed's command at tiny sizes on 4
    ranks, TP=2 + SP x DP=2 with the distributed optimizer, on a Megatron dataset prefix with
    GPT-2 BPE vocab/merges; then `specc plot` of the run."""
    run_dir = tmp_path / "run"
    prefix, tokenizer = gpt2
    env = dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "4", "-m",
           "specc_cli.rank", GPT_TINY, "--tensor-model-parallel-size", "2", "--sequence-parallel",
           "--micro-batch-size", "2", "--global-batch-size", "8", "--num-layers", "2", "--hidden-size", "64",
           "--num-attention-heads", "4", "--seq-length", "32", "--use-distributed-optimizer", "--train-iters", "6",
           "--log-interval", "3", "--eval-interval", "6", "--eval-iters", "1", "--lr", "3e-3", "--data-path", prefix,
           *tokenizer, "--run-dir", str(run_dir), "--no-progress"]
    result = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    out = result.stdout
    assert result.returncode == 0, out[-3000:] + result.stderr[-3000:]
    assert "TP 2 x CP 1 x DP 2 x PP 1" in out and "2 accumulation steps" in out
    assert "distributed over DP=2" in out and "ratio 0.500" in out
    # GPT-2's vocabulary (here 265 ids) padded to a multiple of 128 x TP 2 reaches the model
    assert f"data {prefix}:" in out and "vocabulary 512 (GPT2BPETokenizer, padded to a multiple of 128 x TP 2)" in out
    assert json.load(open(run_dir / "config.json"))["model"]["vocab_size"] == 512 and GPT2_VOCAB_SIZE == 265
    assert "parallel.tp ..." in out and "model.seq_length ..." in out  # the effective configuration
    assert out.count("consumed samples:") == 2 and "validation loss at iteration 6" in out
    records = [json.loads(line) for line in open(run_dir / "metrics.jsonl")]
    assert [r["iteration"] for r in records if r["kind"] == "train"] == list(range(1, 7))
    assert json.load(open(run_dir / "config.json"))["train"]["parallel"]["sp"] is True
    # one event file (rank 0 writes), and Megatron's 'vs samples' series in their own run folder
    board = sorted(os.listdir(run_dir / "tensorboard"))
    assert len(board) == 2 and board[0].startswith("events.out.tfevents.") and board[1] == "vs-samples"
    assert len(os.listdir(run_dir / "tensorboard" / "vs-samples")) == 1
    code, _, err = specc("plot", run_dir)
    png = run_dir / "loss.png"
    assert code == 0 and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000


def test_data_prepare_and_its_errors(specc, tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    (src / "a.txt").write_text("hello")
    (src / "b.txt").write_text("world!")
    code, _, err = specc("data", "prepare", "--input", str(src / "*.txt"), "--tokenizer", "byte",
                         "--output-prefix", tmp_path / "out")
    assert code == 0 and "2 documents, 11 tokens (uint16, vocabulary 256, no EOD (the tokenizer has none)) from 2 " \
        "files" in err
    vocab, merges = gpt2_files(tmp_path)
    code, _, err = specc("data", "prepare", "--input", str(src / "*.txt"), "--tokenizer-type", "GPT2BPETokenizer",
                         "--vocab-file", vocab, "--merge-file", merges, "--output-prefix", tmp_path / "bpe")
    assert code == 0 and f"(uint16, vocabulary {GPT2_VOCAB_SIZE}, EOD {GPT2_VOCAB_SIZE - 1} after each document)" in err
    code, _, err = specc("data", "prepare", "--input", str(src / "*.md"), "--output", tmp_path / "x")
    assert code == 2 and err.strip() == f"error: --input '{src / '*.md'}' matches no files"
    (src / "c.txt").write_bytes(b"\xff\xfe")
    code, _, err = specc("data", "prepare", "--input", str(src / "*.txt"), "--output", tmp_path / "x")
    assert code == 2 and err.strip() == f"error: {src / 'c.txt'}: not UTF-8 text (byte 0xff at offset 0)"
    assert not [n for n in os.listdir(tmp_path) if n.startswith(("x", ".x"))]
    code, _, err = specc("data", "prepare", "--output", tmp_path / "x")
    assert code == 2 and "--input" in err
    code, _, err = specc("data", "prepare", "--stdlib", "--max-files", "3", "--output", tmp_path / "std")
    assert code == 0 and "from 3 files" in err


def test_mock_data_and_a_weighted_blend_train(specc, gpt2, tmp_path):
    small = ("--train-iters", "2", "--micro-batch-size", "2", "--eval-iters", "1", "--log-interval", "1",
             "--no-progress")
    code, out, err = specc("train", GPT_TINY, "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size",
                           "1000", *small, "--run-dir", tmp_path / "mock")
    assert code == 0, out + err
    assert "data mock data (seeded random tokens):" in out and "vocabulary 1024 (NullTokenizer" in out
    assert not (tmp_path / "mock" / "data").exists()  # no files
    from runtime.data import build_tokenizer, prepare, stdlib_files

    prefix, tokenizer = gpt2
    other = str(tmp_path / "other_text_document")  # 20 more files, the same tokenizer
    prepare(stdlib_files()[20:40], build_tokenizer("GPT2BPETokenizer", vocab_file=tokenizer[3], merge_file=tokenizer[5]),
            other)
    code, out, err = specc("train", GPT_TINY, "--data-path", "0.25", prefix, "0.75", other, *tokenizer, *small,
                           "--run-dir", tmp_path / "blend")
    assert code == 0, out + err
    assert f"data 0.25 {prefix} 0.75 {other}:" in out and out.count("consumed samples:") == 2
    code, out, err = specc("train", GPT_TINY, "--train-data-path", prefix, "--valid-data-path", other, *tokenizer,
                           *small, "--run-dir", tmp_path / "per-split")
    assert code == 0, out + err
    assert f"data train {prefix}; valid {other}:" in out and "validation loss at iteration 2" in out


def test_plot_errors(specc, tmp_path):
    code, _, err = specc("plot", tmp_path / "nope")
    assert code == 2 and err.strip() == f"error: {tmp_path / 'nope'}: no such run directory"
    code, _, err = specc("plot", tmp_path)
    assert code == 2 and "no metrics.jsonl" in err and len(err.strip().splitlines()) == 1
    (tmp_path / "metrics.jsonl").write_text("{not json\n")
    code, _, err = specc("plot", tmp_path)
    assert code == 2 and err.strip().endswith("metrics.jsonl:1: not a JSON line")


def test_without_data_path_the_stdlib_corpus_is_prepared_and_reused(specc, tmp_path):
    run_dir = tmp_path / "default"
    args = ("train", GPT_TINY, "--train-iters", "2", "--micro-batch-size", "2", "--eval-iters", "1",
            "--log-interval", "1", "--run-dir", run_dir, "--no-progress")
    code, out, err = specc(*args)
    assert code == 0, out + err
    assert f"wrote {run_dir / 'data' / 'stdlib_text_document'}.bin/.idx:" in err
    meta = json.load(open(run_dir / "data" / "stdlib_text_document.specc.json"))
    assert meta["tokenizer"]["type"] == "byte" and meta["num_documents"] > 100  # the standard library
    assert out.count("consumed samples:") == 2
    code, out, err = specc(*args)  # a second run reuses the prepared corpus
    assert code == 0 and "wrote" not in err
