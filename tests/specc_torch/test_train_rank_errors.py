"""A rank's errors under `specc train` are one line and exit code 2, as with one process: a full
disk during a save (the previous checkpoint intact, nothing of the failed save left), and under
torchrun a rank's checkpoint error (specc_torch/torchrun.py), without torchrun's ChildFailedError
traceback."""

from __future__ import annotations

import errno
import os
import subprocess
import sys

import pytest
from train_cli import GPT_TINY, ROOT, SMALL, one_error_line, small_corpus


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return small_corpus(tmp_path_factory.mktemp("rank_errors"))


def test_a_full_disk_during_a_save_stops_the_run_in_one_line(specc, corpus, tmp_path, monkeypatch):
    import torch.distributed.checkpoint.filesystem as dcp_filesystem

    from runtime.checkpoint import latest_step, lock_save_dir

    write = dcp_filesystem._write_item

    def full_at_step_2(transforms, stream, *args, **kwargs):
        if "step_0000002" in str(getattr(stream, "name", "")):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return write(transforms, stream, *args, **kwargs)

    monkeypatch.setattr(dcp_filesystem, "_write_item", full_at_step_2)
    ckpt = tmp_path / "ckpt"
    code, out, err = specc("train", GPT_TINY, "--train-iters", "3", "--save", ckpt, "--save-interval", "1",
                           "--data-path", corpus, "--run-dir", tmp_path / "run", *SMALL)
    assert code == 2, out + err
    assert one_error_line(err) == (f"error: {ckpt}: saving step 2 failed: the disk is full (No space left on device); "
                                    f"the checkpoint of step 1 is intact and 'latest' still names it, and no part of "
                                    f"step 2 is left; free some space (or keep fewer checkpoints) and resume")
    assert f"saved checkpoint {ckpt / 'step_0000001'}" in out and "step_0000002" not in out
    assert sorted(os.listdir(ckpt)) == ["latest", "run.lock", "step_0000001"] and latest_step(str(ckpt)) == 1
    lock_save_dir(str(ckpt)).release()  # the run let go of its directory


FAKE_RANK = """
import os, time
rank = int(os.environ["RANK"])
if rank == 1:
    raise RuntimeError("a bug")
time.sleep(60)
"""


def test_torchrun_keeps_a_crashing_ranks_traceback_and_ends_in_one_line(tmp_path):
    """A crash that is no user error keeps the rank's traceback and torchrun's log, and ends with
    one line, not ChildFailedError's traceback. (A rank's one-line error is the checkpoint test
    below, end to end; a run that succeeds is every other multi-rank `specc train` test.)"""
    script = tmp_path / "rank.py"
    script.write_text(FAKE_RANK)
    env = dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, "-m", "specc_torch.torchrun", "--standalone", "--nproc-per-node", "2",
                           str(script)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 1, proc.stderr
    assert "RuntimeError: a bug" in proc.stderr and "ChildFailedError" not in proc.stderr
    last = proc.stderr.rstrip("\n").splitlines()[-1]
    assert last.startswith("error: rank 1 (local rank 1, pid ") and last.endswith(") exited with code 1; its "
                                                                                 "output is above"), last


def test_a_checkpoint_error_found_on_one_rank_is_one_line_and_exit_2(specc, corpus, tmp_path, monkeypatch):
    """Saved by one process, loaded at TP=2: the shard's checksum is rank 1's to compute (files are
    shared out by rank), so rank 1 finds the flipped bit and every rank stops on its line."""
    ckpt = tmp_path / "ckpt"
    code, out, err = specc("train", GPT_TINY, "--train-iters", "1", "--save", ckpt, "--data-path", corpus,
                           "--run-dir", tmp_path / "a", *SMALL)
    assert code == 0, out + err
    shard = ckpt / "step_0000001" / "__0_0.distcp"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0x10
    shard.write_bytes(bytes(data))

    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    code, out, err = specc("train", GPT_TINY, "--nproc-per-node", "2", "--tp", "2", "--train-iters", "2", "--load",
                           ckpt, "--data-path", corpus, "--run-dir", tmp_path / "b", *SMALL)
    assert code == 2, out + err
    line = one_error_line(err)
    assert line.startswith(f"error: {ckpt / 'step_0000001'}: file __0_0.distcp is corrupt (crc32 "), line
