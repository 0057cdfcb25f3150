import os
import sys

import pytest

# The gloo rank pools of the runtime tests (tests/runtime/multiproc.py), importable by name here
# and in the spawned ranks.
sys.path.append(os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "runtime"))
from multiproc import DistPools  # noqa: E402


@pytest.fixture(scope="session")
def gloo():
    """gloo.run(world_size, fn, *args) runs fn(rank, world_size, *args) on gloo ranks."""
    pools = DistPools()
    yield pools
    pools.close()


# verify_cli.run_verify: `specc verify` inside the test process, importable by name in the tests here
sys.path.append(os.path.dirname(os.path.abspath(__file__)))
