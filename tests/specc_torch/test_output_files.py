"""`specc train` refuses, before any rank starts, a run directory or save directory whose files
(model.py, plan.txt, plan.json, config.json, metrics.jsonl; `latest`) are anything but regular
files, and `specc hf import|export` write only a new or empty folder, never through a link or over
a FIFO. Each is one line naming the path and what it is; the thing is left as it was."""

from __future__ import annotations

import os
import stat
import threading

import pytest

from runtime.train.config import TrainConfig
from specc_torch.hf import HFError
from specc_torch.hf.files import fresh_output
from specc_torch.train_checks import output_rules

MESSAGE = "not a regular file: only regular files are replaced, and it is left as it is"


def read_beside_a_writer(fifo: str, data: bytes, read, wait: float = 10.0):
    """read() in a thread while a writer holds `fifo` open with `data` in it; the writer is closed
    after `wait` seconds (a reader blocked on the FIFO then sees its end). Returns what read()
    returned or raised."""
    out = []
    fd = os.open(fifo, os.O_RDWR)
    try:
        os.write(fd, data)

        def run():
            try:
                out.append(read())
            except BaseException as e:  # noqa: BLE001 - handed to the test
                out.append(e)

        thread = threading.Thread(target=run, daemon=True)
        thread.start()
        thread.join(wait)
    finally:
        os.close(fd)
    thread.join()
    return out[0]


def test_train_refuses_run_and_save_files_that_are_not_regular_files(tmp_path):
    run, save = tmp_path / "run", tmp_path / "save"
    run.mkdir()
    save.mkdir()
    (tmp_path / "mine.txt").write_text("the user's file\n")
    os.symlink(str(tmp_path / "mine.txt"), str(run / "plan.txt"))
    os.mkfifo(run / "metrics.jsonl")
    (run / "config.json").mkdir()
    # a FIFO `latest`: reading it blocked the check forever (read beside a writer that lets go
    # after 10 s, so that the test fails instead of blocking)
    os.mkfifo(save / "latest")
    (run / "model.py").write_text("# an older run's: a regular file, replaced\n")
    cfg = TrainConfig(spec="x.yaml")
    cfg.logging.run_dir, cfg.checkpoint.save = str(run), str(save)
    assert read_beside_a_writer(str(save / "latest"), b"3\n", lambda: output_rules(cfg)) == [
        f"--save {save}: {save / 'latest'}: is a FIFO (named pipe), not the file naming the latest step",
        f"--run-dir {run}: {run / 'plan.txt'} is a symbolic link (to {tmp_path / 'mine.txt'}), {MESSAGE}",
        f"--run-dir {run}: {run / 'config.json'} is a folder, {MESSAGE}",
        f"--run-dir {run}: {run / 'metrics.jsonl'} is a FIFO (named pipe), {MESSAGE}",
    ]
    assert (tmp_path / "mine.txt").read_text() == "the user's file\n" and os.path.islink(run / "plan.txt")
    assert stat.S_ISFIFO(os.lstat(run / "metrics.jsonl").st_mode) and stat.S_ISFIFO(os.lstat(save / "latest").st_mode)
    for name in ("plan.txt", "metrics.jsonl", "config.json"):
        (os.rmdir if name == "config.json" else os.unlink)(run / name)
    os.unlink(save / "latest")
    assert output_rules(cfg) == []
    # a `latest` that is a link to a step: readable, but a save would replace the link
    (tmp_path / "step.txt").write_text("3\n")
    os.symlink(str(tmp_path / "step.txt"), str(save / "latest"))
    assert output_rules(cfg) == [f"--save {save}: {save / 'latest'} is a symbolic link (to {tmp_path / 'step.txt'}), "
                                 f"{MESSAGE}"]
    assert (tmp_path / "step.txt").read_text() == "3\n"


def test_hf_writes_only_a_new_or_empty_folder(tmp_path):
    (tmp_path / "empty").mkdir()
    os.symlink(str(tmp_path / "empty"), str(tmp_path / "link"))
    os.mkfifo(tmp_path / "fifo")
    (tmp_path / "file").write_text("mine")
    for name, what in [("link", f"a symbolic link (to {tmp_path / 'empty'})"), ("fifo", "a FIFO (named pipe)"),
                       ("file", "a file")]:
        with pytest.raises(HFError) as e:
            fresh_output(str(tmp_path / name))
        assert str(e.value) == (f"{tmp_path / name}: is {what}, not a folder: only a new or empty folder is written, "
                                "and it is left as it is (choose a new directory)")
    with pytest.raises(HFError, match="the output directory is empty"):
        fresh_output("")
    fresh_output(str(tmp_path / "empty"))
    fresh_output(str(tmp_path / "new"))
    assert sorted(os.listdir(tmp_path)) == ["empty", "fifo", "file", "link"]
