"""A save that runs out of disk space is one line that says so; the previous checkpoint stays
intact and named by `latest`, and nothing of the failed save is left behind.

On a real full disk (a 1.5 MB tmpfs), DCP fails inside torch.save with RuntimeError("... unexpected
pos 704 vs 598") whose context is the OSError ENOSPC, raised on every rank as DCP's
CheckpointException (a BaseException). The write is made to fail here in both ways."""

from __future__ import annotations

import errno
import os

import pytest
import torch
import torch.distributed.checkpoint.filesystem as dcp_filesystem
from ckpt_helpers import GPT

import specc_torch
from runtime.checkpoint import CheckpointError, latest_step, load_checkpoint, on_disk, save_checkpoint


def _enospc():
    return OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


def _raise_plain(*args, **kwargs):
    raise _enospc()


def _raise_as_torch_save_does(*args, **kwargs):
    error = RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598")
    error.__context__ = _enospc()  # what torch.save's writer raises while the OSError is handled
    raise error


@pytest.mark.parametrize("how", [_raise_plain, _raise_as_torch_save_does])
def test_a_full_disk_while_writing_shards(tmp_path, monkeypatch, how):
    directory = str(tmp_path / "ckpt")
    model = specc_torch.build_model(GPT, seed=1)
    save_checkpoint(directory, 1, model, scheduler_state={"iteration": 1})
    saved = [p.detach().clone() for p in model.parameters()]
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    monkeypatch.setattr(dcp_filesystem, "_write_item", how)
    with pytest.raises(CheckpointError) as e:
        save_checkpoint(directory, 2, model, scheduler_state={"iteration": 2}, keep_last=1)
    assert str(e.value) == (f"{directory}: saving step 2 failed: the disk is full (No space left on device); the "
                            f"checkpoint of step 1 is intact and 'latest' still names it, and no part of step 2 is "
                            f"left; free some space (or keep fewer checkpoints) and resume")
    assert sorted(os.listdir(directory)) == ["latest", "run.lock", "step_0000001"]  # no step_2.tmp-*
    assert latest_step(directory) == 1
    monkeypatch.undo()
    fresh = specc_torch.build_model(GPT, seed=2)
    assert load_checkpoint(directory, fresh)["step"] == 1
    assert all(torch.equal(a, b) for a, b in zip(saved, fresh.parameters()))
    save_checkpoint(directory, 2, model)  # space again: the next save goes through
    assert latest_step(directory) == 2


def test_a_full_disk_while_writing_checkpoint_json(tmp_path, monkeypatch):
    directory = str(tmp_path / "ckpt")
    model = specc_torch.build_model(GPT, seed=1)
    save_checkpoint(directory, 1, model)
    monkeypatch.setattr(on_disk, "_write_durably", lambda path, text: _raise_plain())
    with pytest.raises(CheckpointError, match=r"saving step 2 failed: the disk is full \(No space left on device\); "
                                              r"the checkpoint of step 1 is intact"):
        save_checkpoint(directory, 2, model)
    assert sorted(os.listdir(directory)) == ["latest", "run.lock", "step_0000001"]
    assert latest_step(directory) == 1


def test_a_first_save_on_a_full_disk(tmp_path, monkeypatch):
    directory = str(tmp_path / "ckpt")
    model = specc_torch.build_model(GPT, seed=1)
    monkeypatch.setattr(dcp_filesystem, "_write_item", _raise_plain)
    with pytest.raises(CheckpointError, match=r"the disk is full \(No space left on device\); nothing was saved "
                                              r"here before, and no part of step 1 is left"):
        save_checkpoint(directory, 1, model)
    assert sorted(os.listdir(directory)) == ["run.lock"]


def test_other_write_failures_are_one_line_too(tmp_path, monkeypatch):
    directory = str(tmp_path / "ckpt")
    model = specc_torch.build_model(GPT, seed=1)

    def eio(*args, **kwargs):
        raise OSError(errno.EIO, os.strerror(errno.EIO))

    monkeypatch.setattr(dcp_filesystem, "_write_item", eio)
    with pytest.raises(CheckpointError) as e:
        save_checkpoint(directory, 1, model)
    assert str(e.value) == f"{directory}: saving step 1 failed: DCPError: rank 0: OSError: [Errno 5] Input/output error"
    assert sorted(os.listdir(directory)) == ["run.lock"]
