"""`specc verify` mistakes and failures are one line: bad settings before any rank starts, and a
rank that fails inside verify named with its error (not its traceback)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from specc_cli.main import main

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
GPT_TINY = os.path.join(ROOT, "specs", "gpt-tiny.yaml")


@pytest.mark.parametrize("argv,expected", [
    (["--mutate", "drop-reductions"], "--mutate drop-reductions: error: unknown mutation (did you mean "
                                      "'drop-reduction'?)"),
    (["--steps", "0"], "--steps 0: error: must be at least 1"),
    (["--batch", "0"], "--batch 0: error: must be at least 1"),
    (["--tolerance", "nan"], "--tolerance nan: error: must be a positive number"),
])
def test_bad_settings_fail_before_ranks_start(capsys, argv, expected):
    assert main(["verify", GPT_TINY, "--tp", "2", *argv]) == 2
    captured = capsys.readouterr()
    assert captured.err == expected + "\n" and captured.out == ""


def test_a_rank_failing_inside_verify_is_one_line(tmp_path):
    # sitecustomize runs first in every interpreter on the path, the spawned ranks included: it
    # makes rank 1 fail where verify's work starts
    (tmp_path / "sitecustomize.py").write_text(textwrap.dedent("""
        import specc_torch.verify as verify

        _verify_all = verify._verify_all

        def failing(rank, cfg):
            if rank == 1:
                raise ValueError("injected failure on rank 1")
            return _verify_all(rank, cfg)

        verify._verify_all = failing
    """))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path), ROOT]))
    result = subprocess.run([sys.executable, "-m", "specc_cli", "verify", GPT_TINY, "--tp", "2", "--sp", "off"], cwd=ROOT,
                            env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 2, result.stdout + result.stderr
    assert result.stderr == "error: specc verify: rank 1 failed: ValueError: injected failure on rank 1\n"
    assert "Traceback" not in result.stdout
