"""A rank's errors under `specc train` are one line and exit code 2: a full disk during a save (the
previous checkpoint intact, nothing of the failed save left)."""

from __future__ import annotations

import errno
import os

import pytest

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
GPT_TINY = os.path.join(ROOT, "specs", "gpt-tiny.yaml")
SMALL = ("--micro-batch-size", "2", "--global-batch-size", "2", "--eval-iters", "0", "--log-interval", "1",
         "--no-progress")


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    from runtime.data import prepare, stdlib_files

    out = str(tmp_path_factory.mktemp("rank_errors") / "corpus")
    prepare(stdlib_files(limit=4), "byte", out)
    return out


@pytest.fixture
def specc(capfd):
    """specc(*argv) -> (exit code, stdout, stderr), in this process, as `specc` runs it."""
    from specc import cli
    from specc.commands import register_all

    def run(*argv):
        parser = cli.build_parser()
        sub = next(a for a in parser._actions if isinstance(a, type(parser._subparsers._group_actions[0])))
        if "train" not in sub.choices:
            register_all(sub)
        build, cli.build_parser = cli.build_parser, lambda: parser
        try:
            code = cli.main([str(a) for a in argv])
        finally:
            cli.build_parser = build
        out, err = capfd.readouterr()
        return code, out, err

    return run


def _one_error_line(err: str) -> str:
    lines = [line for line in err.splitlines() if not line.startswith("launching ")]
    assert len(lines) == 1, err
    assert "Traceback" not in err and "ChildFailedError" not in err, err
    return lines[0]


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
    assert _one_error_line(err) == (f"error: {ckpt}: saving step 2 failed: the disk is full (No space left on device); "
                                    f"the checkpoint of step 1 is intact and 'latest' still names it, and no part of "
                                    f"step 2 is left; free some space (or keep fewer checkpoints) and resume")
    assert f"saved checkpoint {ckpt / 'step_0000001'}" in out and "step_0000002" not in out
    assert sorted(os.listdir(ckpt)) == ["latest", "run.lock", "step_0000001"] and latest_step(str(ckpt)) == 1
    lock_save_dir(str(ckpt)).release()  # the run let go of its directory
