"""Resume at PP = 2 with dropout is bit-exact, with both kinds of schedule (1F1B, one stage per
rank; interleaved 1F1B, two): a run of 4 iterations saving at 2, and a run resumed from that
checkpoint, give the same losses for iterations 3..4 and the same weights at 4, bit for bit.

Dropout makes every RNG state matter: torch's pipeline stages infer their shapes with one real
forward on their first step, which drew dropout masks in the first step of the run (and, before
runtime.pipeline kept the streams untouched there, again in the resumed run's first step, so
its losses differed from the first resumed iteration on)."""

from __future__ import annotations

import io
import json
import os
import re

import pytest
import torch
from train_helpers import make_corpus, tiny_config

from runtime.checkpoint import read_tensors
from specc_torch.train import run

DROPOUT = {"hidden_dropout": 0.1, "attention_dropout": 0.1, "num_layers": 4}


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return make_corpus(str(tmp_path_factory.mktemp("pp_resume")))


def _run(rank, world, data, run_dir, save, load, virtual):
    os.environ.update(WORLD_SIZE=str(world), RANK=str(rank), LOCAL_RANK=str(rank))
    try:
        cfg = tiny_config(world, data, pp=2, mbs=2, gbs=8, train_iters=4, eval_iters=0, overrides=dict(DROPOUT))
        cfg.parallel.pp_virtual_stage_layers = virtual
        cfg.parallel.dp = 1  # derived again inside run
        cfg.logging.run_dir, cfg.logging.progress = run_dir, False
        cfg.checkpoint.save, cfg.checkpoint.save_interval, cfg.checkpoint.load = save, 2, load
        log = io.StringIO()
        return run(cfg, stream=log), log.getvalue()
    finally:
        for key in ("WORLD_SIZE", "RANK", "LOCAL_RANK"):
            os.environ.pop(key, None)


def _losses(run_dir) -> dict:
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return {r["iteration"]: r["loss"] for r in map(json.loads, f) if r["kind"] == "train"}


@pytest.mark.parametrize("virtual", [None, 1], ids=["1f1b", "interleaved"])
def test_pp2_resume_with_dropout_is_bit_exact(gloo, corpus, tmp_path, virtual):
    straight, resumed = str(tmp_path / "straight"), str(tmp_path / "resumed")
    outcomes = gloo.run(2, _run, corpus, straight, straight + "/ckpt", None, virtual)
    assert [code for code, _ in outcomes] == [0, 0], outcomes[0][1]
    # the memory line is pipeline rank 0's own: its stages' weights, gradients and Adam state as
    # planned and as measured (it showed the whole model's plan, and no activations measured)
    (line,) = [ln for ln in outcomes[0][1].splitlines() if ln.startswith("memory per rank, plan / measured")]
    sizes = dict((m[0], (m[1], m[2])) for m in re.findall(r"(\w+) ([\d.]+ \w+) / ([\d.]+ \w+)", line))
    assert all(sizes[k][0] == sizes[k][1] for k in ("parameters", "gradients", "optimizer")), line
    assert not sizes["activations"][1].startswith("0.00") and "pipeline rank 0's stages" in line
    outcomes = gloo.run(2, _run, corpus, resumed, resumed + "/ckpt", straight + "/ckpt/step_0000002", virtual)
    assert [code for code, _ in outcomes] == [0, 0], outcomes[0][1]
    assert "loaded checkpoint" in outcomes[0][1]
    full, again = _losses(straight), _losses(resumed)
    assert sorted(again) == [3, 4]
    assert [again[i] for i in (3, 4)] == [full[i] for i in (3, 4)]  # bit for bit
    a, b = read_tensors(straight + "/ckpt", step=4), read_tensors(resumed + "/ckpt", step=4)
    assert a.keys() == b.keys() and a
    different = [name for name in a if not torch.equal(a[name], b[name])]
    assert different == []
