"""`specc train --nproc-per-node N`'s ranks on the session's gloo pool of N ranks (the `gloo`
fixture) instead of N fresh processes under torchrun: a torchrun launch costs seconds of process
starts (the agent's and every rank's torch import) on this suite's 2 cores.

Everything up to the launch runs as always (the command line, launch's checks, the torchrun
command it builds, with the checked configuration as JSON); only `subprocess.call` of that command
is replaced: each pool rank runs what torchrun would have started there,
`specc_torch.train.rank_main([SPEC, "--config-json", JSON])`, with RANK / WORLD_SIZE / LOCAL_RANK
set as torchrun sets them. Each rank's stdout and stderr come back to this process's, in rank
order, and the exit code is the first rank's that failed (0 when none did), as torchrun's.

The real torchrun launch by `specc train` stays tested where the launch itself is the point:
tests/specc_cli/test_train_pipeline.py (PP 2 x TP 2, 4 ranks), test_train_checkpoints.py
(--max-restarts, a rank killed), tests/specc_torch/test_train_rank_errors.py (a rank's error)."""

from __future__ import annotations

import contextlib
import io
import os
import subprocess
import sys


def _rank(rank, world, argv):
    from specc_torch.train import rank_main

    os.environ.update(WORLD_SIZE=str(world), RANK=str(rank), LOCAL_RANK=str(rank))
    out, err = io.StringIO(), io.StringIO()
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            code = rank_main(argv)
    finally:
        for key in ("WORLD_SIZE", "RANK", "LOCAL_RANK"):
            os.environ.pop(key, None)
    return code, out.getvalue(), err.getvalue()


def install(gloo, monkeypatch) -> list:
    """From now on in this test, `specc train`'s torchrun launches run on `gloo`'s ranks. Returns
    the list of the commands launched (appended as they are)."""
    launched = []

    def call(cmd, env=None):
        train = cmd.index("specc_torch.train")
        assert cmd[1:3] == ["-m", "specc_torch.torchrun"] and cmd[train - 1] == "-m", cmd
        launcher = cmd[3:train - 1]
        assert "--standalone" in launcher and launcher[launcher.index("--nnodes") + 1] == "1", launcher
        assert "--max-restarts" not in launcher, "a restart needs torchrun's agent: launch it for real"
        launched.append(cmd)
        outcomes = gloo.run(int(launcher[launcher.index("--nproc-per-node") + 1]), _rank, cmd[train + 1:])
        for _, out, err in outcomes:
            sys.stdout.write(out)
            sys.stderr.write(err)
        sys.stdout.flush()
        sys.stderr.flush()
        return next((code for code, _, _ in outcomes if code), 0)

    monkeypatch.setattr(subprocess, "call", call)
    return launched
