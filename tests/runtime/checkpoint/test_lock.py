"""One run per save directory: a process that holds the directory's lock keeps every other
process's saves out (one line naming the holder, nothing written), the operating system frees the
lock when the holder dies, even of SIGKILL, and a process saves freely where it holds the lock."""

from __future__ import annotations

import os
import select
import signal
import socket
import subprocess
import sys

import pytest
from ckpt_helpers import GPT, ROOT

import specc_torch
from runtime.checkpoint import (
    CheckpointError,
    SaveDirBusy,
    latest_step,
    load_checkpoint,
    lock_save_dir,
    run_identity,
    same_run,
    save_checkpoint,
)

HOLDER = """
import sys, time
from runtime.checkpoint import lock_save_dir
lock = lock_save_dir(sys.argv[1])
lock.claim()
print("LOCKED", flush=True)
time.sleep(600)
"""


def _holder(directory: str) -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1")
    proc = subprocess.Popen([sys.executable, "-c", HOLDER, directory], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    ready, _, _ = select.select([proc.stdout], [], [], 120)
    line = proc.stdout.readline() if ready else ""
    if line.strip() != "LOCKED":
        proc.kill()
        pytest.fail(f"the holder did not start: {line!r} {proc.stderr.read() if proc.poll() is not None else ''}")
    return proc


def test_another_process_holding_the_lock_keeps_saves_out_until_it_is_killed(tmp_path):
    directory = str(tmp_path / "ckpt")
    model = specc_torch.build_model(GPT, seed=1)
    save_checkpoint(directory, 1, model)
    holder = _holder(directory)
    try:
        with pytest.raises(SaveDirBusy) as e:
            save_checkpoint(directory, 2, model, keep_last=1)
        message = str(e.value)
        assert "\n" not in message
        assert message.startswith(f"{directory}: in use by another run (pid {holder.pid} on {socket.gethostname()}, "
                                  f"since "), message
        assert message.endswith(f"which holds {directory}/run.lock); a save directory belongs to one run at a "
                                f"time: wait for it to end, or save into another directory")
        assert sorted(os.listdir(directory)) == ["latest", "run.lock", "step_0000001"]  # nothing written or pruned
        with pytest.raises(SaveDirBusy, match=f"pid {holder.pid} "):
            lock_save_dir(directory)
    finally:
        os.kill(holder.pid, signal.SIGKILL)
        holder.wait(timeout=30)

    # SIGKILL leaves no stale lock: the next process takes it at once, and reads who had it
    with lock_save_dir(directory) as lock:
        assert lock.previous["pid"] == holder.pid and lock.previous["host"] == socket.gethostname()
        lock.claim()
        save_checkpoint(directory, 2, model, keep_last=1)  # this process holds it: its saves go through
        assert latest_step(directory) == 2 and load_checkpoint(directory, model)["step"] == 2
        with pytest.raises(SaveDirBusy, match="this process already holds its lock"):
            lock_save_dir(directory)
    save_checkpoint(directory, 3, model)  # released: a save takes it for its own time
    assert latest_step(directory) == 3


def test_the_lock_file_is_a_regular_file_or_nothing(tmp_path):
    directory = tmp_path / "ckpt"
    directory.mkdir()
    (tmp_path / "elsewhere").write_text("keep\n")
    os.symlink(tmp_path / "elsewhere", directory / "run.lock")
    with pytest.raises(CheckpointError, match="run.lock: not a regular file"):
        lock_save_dir(str(directory))
    assert (tmp_path / "elsewhere").read_text() == "keep\n"


def test_an_elastic_restart_knows_its_own_record(monkeypatch):
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "3f2a")
    mine = run_identity()
    assert same_run(dict(mine, pid=1), mine)  # an earlier attempt: another pid, the same run id
    assert not same_run(dict(mine, run="77b0"), mine)
    assert not same_run(None, mine)
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "none")  # torchrun's default id, shared by every job
    mine = run_identity()
    assert same_run(dict(mine, pid=1), mine)
    assert not same_run(dict(mine, agent="node3:4242"), mine)
    monkeypatch.delenv("TORCHELASTIC_RUN_ID")
    assert not same_run(run_identity(), run_identity())  # not under torchrun: never a restart
