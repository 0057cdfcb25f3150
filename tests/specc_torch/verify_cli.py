"""`specc verify ARGS` as `python -m specc_cli verify ARGS` run from the repository root reports it
(exit code, stdout, stderr), but called inside the test process: verify's ranks are forks of one
forkserver per process (specc_torch.verify.verify), so a call here starts no interpreter and
imports no torch, where a subprocess paid both twice (its own and its forkserver's), seconds per
call. The subprocess entry point itself is exercised by tests/specc/test_verify_errors.py."""

from __future__ import annotations

import contextlib
import io
import os
import subprocess

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))


def run_verify(*args) -> subprocess.CompletedProcess:
    from specc_cli.main import main

    out, err = io.StringIO(), io.StringIO()
    here = os.getcwd()
    os.chdir(ROOT)  # relative spec paths, as with cwd=ROOT; the ranks start in this folder too
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                code = main(["verify", *map(str, args)])
            except SystemExit as e:  # argparse's exit on a bad flag
                code = e.code if isinstance(e.code, int) else 2
    finally:
        os.chdir(here)
    return subprocess.CompletedProcess(["specc", "verify", *map(str, args)], code, out.getvalue(), err.getvalue())
