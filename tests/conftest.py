"""Fixtures every test folder shares."""

import os
import sys

import pytest

# tests/runtime/multiproc.py (the gloo rank pools), importable by name here and in the spawned ranks
sys.path.append(os.path.join(os.path.dirname(os.path.abspath(__file__)), "runtime"))


@pytest.fixture(scope="session")
def gloo():
    """gloo.run(world_size, fn, *args) runs fn(rank, world_size, *args) on gloo ranks: one pool per
    world size for the whole session, every folder's tests alike (a pool's start costs a torch
    import per rank)."""
    from multiproc import DistPools

    pools = DistPools()
    yield pools
    pools.close()


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
