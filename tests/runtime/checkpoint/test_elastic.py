"""Fault tolerance with torchrun's elastic restarts, at the library level: one of 2 gloo ranks is
killed with SIGKILL mid-run; torchrun (--max-restarts 1) restarts the group, the ranks resume from
the last complete checkpoint, and the run finishes with the losses of a run nobody killed."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest
from ckpt_helpers import ROOT

from runtime.checkpoint import complete_steps, latest_step

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "ckpt_elastic_worker.py")
STEPS = 6


def _torchrun(directory: str, log: str, kill: int) -> subprocess.CompletedProcess:
    torchrun = shutil.which("torchrun", path=os.path.dirname(sys.executable))
    if torchrun is None:
        pytest.skip("torchrun is not installed beside this Python")
    env = dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1")
    return subprocess.run([torchrun, "--standalone", "--nproc-per-node", "2", "--max-restarts", "1",
                           "--monitor-interval", "0.5", WORKER, directory, log, str(STEPS), str(kill)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)


def _losses(log: str) -> list:
    with open(log) as f:
        return [(int(a), int(s), float(x)) for a, s, x in (line.split() for line in f)]


def test_a_killed_rank_restarts_from_the_last_checkpoint_and_finishes(tmp_path):
    straight = _torchrun(str(tmp_path / "a"), str(tmp_path / "a.log"), kill=0)
    assert straight.returncode == 0, straight.stderr[-3000:]
    killed = _torchrun(str(tmp_path / "b"), str(tmp_path / "b.log"), kill=4)
    assert killed.returncode == 0, killed.stderr[-3000:]

    reference = {s: x for _, s, x in _losses(str(tmp_path / "a.log"))}
    lines = _losses(str(tmp_path / "b.log"))
    first = [(s, x) for a, s, x in lines if a == 0]
    second = [(s, x) for a, s, x in lines if a == 1]
    assert [s for s, _ in first] == [1, 2, 3]  # rank 1 died before step 4
    assert [s for s, _ in second] == [3, 4, 5, 6]  # resumed from step 2, the last save
    assert all(x == reference[s] for s, x in first + second)  # bit-identical, dropout included
    assert latest_step(str(tmp_path / "b")) == STEPS and complete_steps(str(tmp_path / "b")) == [4, 6]
