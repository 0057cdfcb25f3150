"""`specc train` and `specc hf export` mistakes that used to print a traceback (or train and then
die): each is one `error:` line and exit 2, found before any rank starts and before anything is
written."""

from __future__ import annotations

import json
import os

import pytest

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
GPT_TINY = os.path.join(ROOT, "specs", "gpt-tiny.yaml")


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    from runtime.data import prepare, stdlib_files

    out = str(tmp_path_factory.mktemp("errors") / "corpus")
    prepare(stdlib_files(limit=2), "byte", out)
    return out


def _one_line(result, starts: str) -> str:
    code, out, err = result
    assert code == 2, out + err
    assert err.count("\n") == 1 and err.endswith("\n"), f"not one line: {err!r}"
    assert err.startswith(starts), err
    assert "Traceback" not in err and "usage:" not in err
    return err.rstrip("\n")


@pytest.fixture
def train(specc, corpus, tmp_path):
    """specc train gpt-tiny with a run directory that must never appear."""
    run_dir = tmp_path / "never"

    def run(*argv, data=corpus, extra=()):
        result = specc("train", GPT_TINY, *(("--data-path", data) if data is not None else extra), "--train-iters",
                       "1", "--eval-iters", "0", "--no-progress", *argv,
                       *(() if "--run-dir" in argv else ("--run-dir", run_dir)))
        assert not run_dir.exists(), "a run started"
        return result

    return run


def test_save_and_run_dir_that_are_files(train, tmp_path):
    afile = tmp_path / "afile"
    afile.write_text("mine\n")
    _one_line(train("--save", afile), f"error: --save {afile}: exists and is not a directory")
    _one_line(train("--run-dir", afile), f"error: --run-dir {afile}: exists and is not a directory")
    _one_line(train("--save", afile / "ckpt"), f"error: --save {afile / 'ckpt'}: cannot be created: {afile} is not "
              "a directory")
    assert afile.read_text() == "mine\n"


def test_device_cuda_without_cuda(train, monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    _one_line(train("--device", "cuda"), "error: --device cuda: CUDA is not available here (torch ")


def test_master_port_out_of_range(train):
    _one_line(train("--nproc-per-node", "2", "--master-port", "99999"),
              "error: --master-port 99999: a port is between 1 and 65535")
    _one_line(train("--nproc-per-node", "2", "--rdzv-endpoint", "localhost:70000"),
              "error: --rdzv-endpoint localhost:70000: expected HOST:PORT")


@pytest.mark.parametrize("flag,value", [("--lr", "nan"), ("--lr", "inf"), ("--weight-decay", "nan"),
                                        ("--adam-eps", "-inf"), ("--clip-grad", "nan")])
def test_numbers_that_are_not_finite(train, flag, value):
    _one_line(train(f"{flag}={value}"), f"error: {flag} must be a finite number, got {float(value)}")


def test_token_ids_outside_the_vocabulary_are_found_at_load(train, tmp_path):
    import numpy as np

    from runtime.data import IndexedDatasetBuilder

    prefix = str(tmp_path / "megatron_text_document")  # as Megatron's preprocess_data leaves it: no specc sidecar
    builder = IndexedDatasetBuilder(prefix + ".bin", np.uint16)
    for doc in (np.arange(200), np.arange(300) % 256, np.array([5, 300, 7, 12])):
        builder.add_item(doc)
        builder.end_document()
    builder.finalize(prefix + ".idx")
    _one_line(train(data=prefix), f"error: --data-path {prefix}: {prefix}.bin holds token id 300 (its largest), "
              f"outside the model's vocabulary of 256 (ids 0..255); prepare the data with the model's tokenizer, "
              f"give its --tokenizer-type, or --set vocab_size=301 or more")
    # given as one split's data, the error names that flag
    _one_line(train(data=None, extra=("--train-data-path", prefix)),
              f"error: --train-data-path {prefix}: {prefix}.bin holds token id 300 (its largest)")


def test_data_path_mistakes(specc, train, corpus, tmp_path):
    _one_line(train(data=tmp_path / "my-corpus_text_document"),
              f"error: --data-path {tmp_path / 'my-corpus_text_document'}: no my-corpus_text_document.bin and "
              "my-corpus_text_document.idx (a dataset is a path prefix")
    _one_line(train(data=None, extra=("--data-path", "0.3", corpus, corpus, "0.7")),
              "error: --data-path: blend weight")
    _one_line(train("--mock-data"), "error: --mock-data and --data-path: give one")
    _one_line(train("--mock-data", data=None, extra=("--train-data-path", corpus)),
              "error: --mock-data and --train-data-path/--valid-data-path/--test-data-path: give one")
    _one_line(train("--train-data-path", corpus), "error: --data-path and --train-data-path/--valid-data-path/"
              "--test-data-path: give one")
    _one_line(specc("train", GPT_TINY, "--train-data-path", corpus, "--eval-iters", "1", "--run-dir", tmp_path / "no"),
              "error: --eval-iters 1 evaluates on the valid split: give --valid-data-path PREFIX, or --eval-iters 0")
    _one_line(train("--split", "9,x"), "error: --split 9,x: weights must be numbers")
    _one_line(train("--tokenizer-type", "GPT2BPETokenizer"), "error: --vocab-file is needed")
    _one_line(train("--tokenizer-type", "NullTokenizer", "--vocab-size", "300", "--set", "vocab_size=256"),
              "error: --set vocab_size=256 is smaller than the NullTokenizer vocabulary (301); drop it to use the "
              "padded 384")


def test_sequence_parallel_at_tp1_is_turned_off_as_megatron_does(specc, corpus, tmp_path):
    code, out, err = specc("train", GPT_TINY, "--sequence-parallel", "--train-iters", "1", "--eval-iters", "0",
                           "--no-progress", "--data-path", corpus, "--run-dir", tmp_path / "run")
    assert code == 0, err
    assert "note: --sequence-parallel at --tensor-model-parallel-size 1: sequence parallelism is off" in out


def test_conflicting_duplicate_flags(train):
    _one_line(train("--tp", "2", "--tensor-model-parallel-size", "4"),
              "error: argument --tensor-model-parallel-size/--tp: given twice with different values: --tp 2 and "
              "--tensor-model-parallel-size 4 (hint: see specc train --help)")
    _one_line(train("--progress"), "error: argument --progress: given twice with different values: --no-progress "
              "and --progress")  # the fixture gives --no-progress


@pytest.mark.parametrize("argv", [["--swiglu"], ["--group-query-attention"],
                                  ["--normalization", "RMSNorm"], ["--position-embedding-type", "rope"],
                                  ["--disable-bias-linear"]])
def test_megatron_architecture_flags(train, argv, names_bases_that_declare_it):
    given = " ".join(argv)  # (with --num-query-groups 4 too: a line each, test_megatron_scripts.py)
    err = _one_line(train(*argv), f"error: {given} is a Megatron architecture flag: here the spec holds the "
                    "architecture")
    hint = err.split(" (hint: ", 1)[1]
    assert "specs/gpt" not in hint and ": specc train specs/" in hint
    names_bases_that_declare_it(hint)


def _checkpoint(root, info=None, latest="1\n"):
    """A save directory whose latest is `latest` (bytes, str, or None: a directory) and whose
    step_0000001/checkpoint.json is `info`."""
    os.makedirs(root / "step_0000001")
    if latest is None:
        os.makedirs(root / "latest")
    else:
        (root / "latest").write_bytes(latest if isinstance(latest, bytes) else latest.encode())
    if info is not None:
        (root / "step_0000001" / "checkpoint.json").write_text(json.dumps(info))
    return root


INFO = {"format": "specc-checkpoint", "version": 1, "step": 1, "spec": {"name": "gpt_tiny", "sha256": None},
        "layout": {"tp": 1, "cp": 1, "dp": 1, "pp": 1, "world_size": 1},
        "params": {"embedding.weight": {"shape": [256, 64], "dtype": "float32"}}, "optimizer": None,
        "scheduler": False, "data": False, "rng": False, "files": {}}


@pytest.mark.parametrize("latest,info,what", [
    (None, None, "latest: is a directory, not the file naming the latest step"),
    (b"\x00\xff\x13\n", None, "latest: expected a step number, found '\\x00"),
    ("1\n", {k: v for k, v in INFO.items() if k != "params"}, "step_0000001: checkpoint.json is corrupt: no 'params'"),
    ("1\n", {**INFO, "step": "1"}, "step_0000001: checkpoint.json is corrupt: 'step' must be a non-negative integer, "
     "found \"1\""),
    ("1\n", {**INFO, "layout": [1, 1]}, "step_0000001: checkpoint.json is corrupt: 'layout' must be an object"),
    ("1\n", {**INFO, "params": {"w": {"shape": "256", "dtype": "float32"}}},
     "step_0000001: checkpoint.json is corrupt: parameter 'w' must have a 'shape'"),
    ("1\n", {**INFO, "files": {"../../x": {"bytes": 1, "crc32": "0"}}},
     "step_0000001: checkpoint.json is corrupt: file name '../../x' is not a plain file name"),
])
def test_broken_checkpoints_for_load_and_hf_export(train, specc, tmp_path, latest, info, what):
    ckpt = _checkpoint(tmp_path / "ckpt", info, latest)
    _one_line(train("--load", ckpt), f"error: --load {ckpt}: {ckpt}/{what}")
    out = tmp_path / "hf"
    where, _, rest = what.partition(": ")
    _one_line(specc("hf", "export", ckpt, "--spec", GPT_TINY, "--out", out), f"{ckpt}/{where}: error: {rest}")
    assert not out.exists()
    if latest is None:  # and as the place to save into: a save would fail after training
        _one_line(train("--save", ckpt), f"error: --save {ckpt}: {ckpt}/{what}")

