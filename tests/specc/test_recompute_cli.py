"""Megatron's recompute flags and the spec's `recompute:` on the command line: bad combinations
are one-line errors naming the flag (or the spec's line and column), the generated code shows the
recompute as a readable call, and a folder compiled with recompute round-trips through check."""

from __future__ import annotations

import os

import pytest

from specc_cli.main import main

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
TINY = os.path.join(ROOT, "specs", "gpt-tiny.yaml")


def _error(capsys, *argv) -> str:
    assert main(list(argv)) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err  # one line
    return err


@pytest.mark.parametrize("flags,named,says", [
    (["--recompute-method", "uniform"], "--recompute-method uniform", "without --recompute-granularity full"),
    (["--recompute-num-layers", "2"], "--recompute-num-layers 2", "without --recompute-granularity full"),
    (["--recompute-granularity", "full"], "--recompute-granularity full", "needs --recompute-method"),
    (["--recompute-granularity", "selective", "--recompute-method", "block"], "--recompute-method block",
     "full only"),
    (["--recompute-granularity", "full", "--recompute-method", "block", "--recompute-num-layers", "0"],
     "--recompute-num-layers 0", "at least 1"),
    (["--recompute-granularity", "full", "--recompute-method", "uniform", "--recompute-num-layers", "3"],
     "--recompute-num-layers 3", "more than the 2 layers of 'layers'"),
    (["--recompute-granularity", "fine"], "--recompute-granularity", "invalid choice"),
])
def test_bad_flag_combinations_are_one_line_errors(capsys, flags, named, says):
    err = _error(capsys, "plan", TINY, *flags)
    assert named in err and says in err, err


def _spec(tmp_path, text: str) -> str:
    path = tmp_path / "s.yaml"
    path.write_text(f"extends: {TINY}\n" + text)
    return str(path)


@pytest.mark.parametrize("text,where,says", [
    ("modules:\n  MLP:\n    recompute: fulll\n", ":4:16", "did you mean 'full'?"),
    ("modules:\n  GPTModel:\n    recompute: full\n", ":4:16", "root module 'GPTModel' cannot be recomputed"),
    ("modules:\n  MLP:\n    recompute: selective\n", ":4:16", "holds no op that selective recompute covers"),
    ("modules:\n  MLP:\n    recompute: 3\n", ":4:16", "must be one of full, selective, got an integer"),
])
def test_bad_spec_declarations_are_located(capsys, tmp_path, text, where, says):
    path = _spec(tmp_path, text)
    err = _error(capsys, "plan", path)
    assert f"{path}{where}" in err and says in err, err


def test_generated_code_calls_recompute_and_check_round_trips(capsys, tmp_path):
    spec = _spec(tmp_path, "modules:\n  MLP:\n    recompute: full\n")
    assert main(["compile", spec, "--tp", "2", "--sp", "-o", str(tmp_path / "gen"),
                 "--recompute-granularity", "selective"]) == 0
    source = (tmp_path / "gen" / "gpt_tiny_tp2_sp_recompute_selective" / "model.py").read_text()
    assert "runtime.recompute(self.mlp, pre_mlp_layernorm_out, rng_tracker=self.rng_tracker)" in source
    assert "runtime.recompute(self.core_attention, q, k, v, rng_tracker=self.rng_tracker)" in source
    assert "self.rng_tracker = rng_tracker" in source
    assert "'recompute_granularity': 'selective'" in source
    assert main(["compile", TINY, "-o", str(tmp_path / "gen"), "--recompute-granularity", "full",
                 "--recompute-method", "block", "--recompute-num-layers", "1"]) == 0
    block = (tmp_path / "gen" / "gpt_tiny_recompute_block1" / "model.py").read_text()
    assert "h = runtime.recompute(layer, h, rng_tracker=self.rng_tracker) if i < 1 else layer(h)" in block
    assert "--recompute-granularity full --recompute-method block --recompute-num-layers 1" in block
    capsys.readouterr()
    assert main(["check", str(tmp_path / "gen")]) == 0, capsys.readouterr()


def test_verify_refuses_bad_recompute_flags_before_starting_ranks(capsys):
    err = _error(capsys, "verify", TINY, "--tp", "2", "--recompute-granularity", "full")
    assert "needs --recompute-method" in err
