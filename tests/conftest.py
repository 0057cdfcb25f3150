"""Fixtures every test folder shares."""

import pytest


@pytest.fixture
def specc(capfd):
    """specc(*argv) -> (exit code, stdout, stderr), in this process, as the `specc` command runs it
    (specc_cli.main)."""
    from specc_cli.main import main

    def run(*argv):
        code = main([str(a) for a in argv])
        out, err = capfd.readouterr()
        return code, out, err

    return run
