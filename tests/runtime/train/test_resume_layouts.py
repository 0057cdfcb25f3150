"""Resume is bit-exact at every parallel axis, with dropout on: a run of 4 iterations saving at 2
(resume_rank.py), and a run that continues from that checkpoint, give the same losses for
iterations 3..4 and the same weights at 4, bit for bit, at

- PP 2, 1F1B: the run continued is one whose last rank was killed with SIGKILL before iteration 3,
  under torchrun with --max-restarts 1: the restarted ranks resume from their own --save (the
  elastic restart);
- PP 2, interleaved (two stages per rank): a clean stop, a new run with --load;
- TP 2 x CP 2 (4 ranks): a clean stop, --load (the RNG streams differ per TP and per CP rank:
  each rank's own must come back);
- EP 2 (DP 2, routed experts with an auxiliary loss and a balancing bias that moves every step,
  tests/runtime/train/specs/gpt-moe-tiny.yaml): a clean stop, --load; and SIGKILL of rank 0 (the
  rank that holds the --save lock and writes metrics.jsonl) under torchrun, restarted.

(tests/specc_cli/test_train_checkpoints.py kills rank 0 of a TP 2 + SP run with dropout through
`specc train --max-restarts`.) The uninterrupted run of each layout runs once, on the session's
gloo ranks, and is the reference of both continuations of its layout.

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
from resume_rank import parse_layout, run_on_rank
from train_helpers import make_corpus

from runtime.checkpoint import complete_steps, read_tensors

RANK_SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "resume_rank.py")


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return make_corpus(str(tmp_path_factory.mktemp("resume")))


@pytest.fixture(scope="module")
def straight(gloo, corpus, tmp_path_factory):
    """straight(layout) -> the run directory of the layout's uninterrupted run (made once)."""
    done = {}

    def get(layout: str) -> str:
        if layout not in done:
            run_dir = str(tmp_path_factory.mktemp("straight"))
            outcomes = gloo.run(_world(layout), run_on_rank, corpus, run_dir, run_dir + "/ckpt", None, layout)
            assert [code for code, _ in outcomes] == [0] * len(outcomes), outcomes[0][1]
            if parse_layout(layout).get("pp"):
                _check_memory_line(outcomes[0][1])
            done[layout] = run_dir
        return done[layout]

    return get


def _world(layout: str) -> int:
    lay = parse_layout(layout)
    return lay.get("tp", 1) * lay.get("cp", 1) * lay.get("pp", 1) * lay.get("ep", 1)  # DP = EP


def _check_memory_line(log: str) -> None:
    """At PP the memory line is pipeline rank 0's own: its stages' weights, gradients and Adam
    state as planned and as measured (it showed the whole model's plan, and no activations
    measured)."""
    (line,) = [ln for ln in log.splitlines() if ln.startswith("memory per rank, plan / measured")]
    sizes = dict((m[0], (m[1], m[2])) for m in re.findall(r"(\w+) ([\d.]+ \w+) / ([\d.]+ \w+)", line))
    assert all(sizes[k][0] == sizes[k][1] for k in ("parameters", "gradients", "optimizer")), line
    assert not sizes["activations"][1].startswith("0.00") and "pipeline rank 0's stages" in line


def _losses(run_dir) -> dict:
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return {r["iteration"]: r["loss"] for r in map(json.loads, f) if r["kind"] == "train"}


def _killed_and_restarted(corpus: str, run_dir: str, layout: str, kill_rank: int | None) -> None:
    """The run under torchrun, rank `kill_rank` (None: the last) SIGKILLed before iteration 3
    (specc_torch.train's test hook), restarted once."""
    env = dict(os.environ, SPECC_TEST_KILL_AT_ITER="3", OMP_NUM_THREADS="1")
    env.pop("SPECC_TEST_KILL_RANK", None)
    if kill_rank is not None:
        env["SPECC_TEST_KILL_RANK"] = str(kill_rank)
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
                           str(_world(layout)), "--max-restarts", "1", RANK_SCRIPT, corpus, run_dir, layout],
                          env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]
    assert "exitcode: -9" in done.stderr  # torchrun saw the rank die of SIGKILL, and restarted it
    assert f"loaded checkpoint {run_dir}/ckpt/step_0000002 at iteration 2" in done.stdout, done.stdout


@pytest.mark.parametrize("layout, killed", [("pp=2", None), ("ep=2,moe", 0),
                                            ("pp=2,virtual=1", False), ("tp=2,cp=2", False), ("ep=2,moe", False)],
                         ids=["pp2_1f1b_killed", "ep2_killed", "pp2_interleaved", "tp2_cp2", "ep2"])
def test_resume_with_dropout_is_bit_exact(gloo, corpus, straight, tmp_path, layout, killed):
    full_dir, resumed = straight(layout), str(tmp_path / "resumed")
    if killed is not False:
        _killed_and_restarted(corpus, resumed, layout, killed)
        assert complete_steps(resumed + "/ckpt") == [2, 4]
    else:
        outcomes = gloo.run(_world(layout), run_on_rank, corpus, resumed, resumed + "/ckpt",
                            full_dir + "/ckpt/step_0000002", layout)
        assert [code for code, _ in outcomes] == [0] * len(outcomes), outcomes[0][1]
        assert "loaded checkpoint" in outcomes[0][1]
    full, again = _losses(full_dir), _losses(resumed)
    # the killed run logged iterations 1..2 before the kill (flushed by the checkpoint), then 3..4
    # again from the checkpoint, each once; the --load run logs only its own 3..4
    assert sorted(again) == ([1, 2, 3, 4] if killed is not False else [3, 4])
    assert [again[i] for i in sorted(again)] == [full[i] for i in sorted(again)]  # bit for bit
    a, b = read_tensors(full_dir + "/ckpt", step=4), read_tensors(resumed + "/ckpt", step=4)
    assert a.keys() == b.keys() and a
    different = [name for name in a if not torch.equal(a[name], b[name])]
    assert different == []
