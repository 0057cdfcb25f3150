"""Atomic saves: a save killed with SIGKILL in the middle of writing a shard, while writing
checkpoint.json, or after the rename but before `latest` moves, leaves the previous checkpoint
intact, loadable and named by `latest`; the next save cleans up and succeeds. --keep-last prunes."""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys

import pytest
import torch
from ckpt_helpers import GPT, ROOT
from ckpt_kill_worker import SIZE

import specc_torch
from runtime.checkpoint import CheckpointError, complete_steps, latest_step, load_checkpoint, save_checkpoint

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "ckpt_kill_worker.py")


def _model(seed: int):
    return specc_torch.build_model(GPT, seed=seed, overrides=SIZE)


def _kill_at(directory: str, phase: str, seed: int, step: int) -> None:
    env = dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1")
    proc = subprocess.Popen([sys.executable, WORKER, directory, phase, str(seed), str(step)], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        ready, _, _ = select.select([proc.stdout], [], [], 120)
        line = proc.stdout.readline() if ready else ""
        assert line.strip() == f"PAUSED {phase}", proc.stderr.read() if proc.poll() is not None else line
        os.kill(proc.pid, signal.SIGKILL)
    finally:
        proc.kill()
        proc.wait(timeout=30)
    assert proc.returncode == -signal.SIGKILL


def _weights(model):
    return [p.detach().clone() for p in model.parameters()]


def _loads_as(directory: str, expected) -> int:
    model = _model(seed=77)
    out = load_checkpoint(directory, model)
    assert all(torch.equal(a, b) for a, b in zip(_weights(model), expected))
    return out["step"]


def test_killed_saves_leave_the_last_complete_checkpoint(tmp_path):
    directory = str(tmp_path / "ckpt")
    first = _model(seed=1)
    save_checkpoint(directory, 1, first)
    saved = _weights(first)

    for phase in ("write", "info", "latest"):
        _kill_at(directory, phase, seed=2, step=2)
        assert latest_step(directory) == 1, phase
        assert _loads_as(directory, saved) == 1, phase
        leftovers = sorted(os.listdir(directory))
        if phase == "latest":  # complete, but never published: latest still names step 1
            assert "step_0000002" in leftovers and complete_steps(directory) == [1, 2]
        else:  # the killed save's temporary directory (removed by the next save)
            tmp = [e for e in leftovers if e.startswith("step_0000002.tmp-")]
            assert len(tmp) == 1 and complete_steps(directory) == [1], leftovers
            files = os.listdir(os.path.join(directory, tmp[0]))
            if phase == "write":  # killed in the middle of writing its shard
                assert files == ["__0_0.distcp"]
                full = os.path.getsize(os.path.join(directory, "step_0000001", "__0_0.distcp"))
                assert 0 < os.path.getsize(os.path.join(directory, tmp[0], files[0])) < full // 2

    # the next save of step 2 replaces the unpublished one and removes what the kills left
    again = _model(seed=3)
    save_checkpoint(directory, 2, again)
    assert sorted(os.listdir(directory)) == ["latest", "run.lock", "step_0000001", "step_0000002"]
    assert latest_step(directory) == 2
    assert _loads_as(directory, _weights(again)) == 2


def test_keep_last_prunes_older_checkpoints(tmp_path):
    directory = str(tmp_path / "ckpt")
    model = specc_torch.build_model(GPT, seed=1)
    for step in (10, 20, 30, 40):
        save_checkpoint(directory, step, model, keep_last=2)
    assert sorted(os.listdir(directory)) == ["latest", "run.lock", "step_0000030", "step_0000040"]
    save_checkpoint(directory, 50, model)  # no keep_last: nothing is pruned
    assert complete_steps(directory) == [30, 40, 50]
    assert load_checkpoint(directory, model, step=30)["step"] == 30
    with pytest.raises(CheckpointError, match="step_0000020: no such checkpoint"):
        load_checkpoint(directory, model, step=20)
    with pytest.raises(ValueError, match="keep_last must be a positive integer"):
        save_checkpoint(directory, 60, model, keep_last=0)
