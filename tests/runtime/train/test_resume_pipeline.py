"""Resume at PP = 2 with dropout is bit-exact, with both kinds of schedule (1F1B, one stage per
rank; interleaved 1F1B, two): a run of 4 iterations saving at 2 (pp_resume_rank.py), and a run
that continues from that checkpoint, give the same losses for iterations 3..4 and the same weights
at 4, bit for bit. With 1F1B the run continued is one whose last rank was killed with SIGKILL
before iteration 3, under torchrun with --max-restarts 1: the restarted ranks resume from their own
--save (the elastic restart); interleaved, a new run with --load.

Dropout makes every RNG state matter: torch's pipeline stages infer their shapes with one real
forward on their first step, which drew dropout masks in the first step of the run (and, before
runtime.pipeline kept the streams untouched there, again in the resumed run's first step, so
its losses differed from the first resumed iteration on)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest
import torch
from pp_resume_rank import run_on_rank
from train_helpers import make_corpus

from runtime.checkpoint import complete_steps, read_tensors

RANK_SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "pp_resume_rank.py")


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return make_corpus(str(tmp_path_factory.mktemp("pp_resume")))


def _losses(run_dir) -> dict:
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return {r["iteration"]: r["loss"] for r in map(json.loads, f) if r["kind"] == "train"}


def _killed_and_restarted(corpus: str, run_dir: str) -> None:
    """The run under torchrun, its last rank SIGKILLed before iteration 3 (specc_torch.train's
    test hook), restarted once."""
    env = dict(os.environ, SPECC_TEST_KILL_AT_ITER="3", OMP_NUM_THREADS="1")
    env.pop("SPECC_TEST_KILL_RANK", None)
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                           "--max-restarts", "1", RANK_SCRIPT, corpus, run_dir],
                          env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]
    assert "exitcode: -9" in done.stderr  # torchrun saw the rank die of SIGKILL, and restarted it
    assert f"loaded checkpoint {run_dir}/ckpt/step_0000002 at iteration 2" in done.stdout, done.stdout


@pytest.mark.parametrize("virtual", [None, 1], ids=["1f1b_killed", "interleaved"])
def test_pp2_resume_with_dropout_is_bit_exact(gloo, corpus, tmp_path, virtual):
    straight, resumed = str(tmp_path / "straight"), str(tmp_path / "resumed")
    outcomes = gloo.run(2, run_on_rank, corpus, straight, straight + "/ckpt", None, virtual)
    assert [code for code, _ in outcomes] == [0, 0], outcomes[0][1]
    # the memory line is pipeline rank 0's own: its stages' weights, gradients and Adam state as
    # planned and as measured (it showed the whole model's plan, and no activations measured)
    (line,) = [ln for ln in outcomes[0][1].splitlines() if ln.startswith("memory per rank, plan / measured")]
    sizes = dict((m[0], (m[1], m[2])) for m in re.findall(r"(\w+) ([\d.]+ \w+) / ([\d.]+ \w+)", line))
    assert all(sizes[k][0] == sizes[k][1] for k in ("parameters", "gradients", "optimizer")), line
    assert not sizes["activations"][1].startswith("0.00") and "pipeline rank 0's stages" in line
    if virtual is None:
        _killed_and_restarted(corpus, resumed)
        assert complete_steps(resumed + "/ckpt") == [2, 4]
    else:
        outcomes = gloo.run(2, run_on_rank, corpus, resumed, resumed + "/ckpt", straight + "/ckpt/step_0000002",
                            virtual)
        assert [code for code, _ in outcomes] == [0, 0], outcomes[0][1]
        assert "loaded checkpoint" in outcomes[0][1]
    full, again = _losses(straight), _losses(resumed)
    # the killed run logged iterations 1..2 before the kill (flushed by the checkpoint), then 3..4
    # again from the checkpoint, each once; the --load run logs only its own 3..4
    assert sorted(again) == ([1, 2, 3, 4] if virtual is None else [3, 4])
    assert [again[i] for i in sorted(again)] == [full[i] for i in sorted(again)]  # bit for bit
    a, b = read_tensors(straight + "/ckpt", step=4), read_tensors(resumed + "/ckpt", step=4)
    assert a.keys() == b.keys() and a
    different = [name for name in a if not torch.equal(a[name], b[name])]
    assert different == []
