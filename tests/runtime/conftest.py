import pytest

try:  # tests/runtime as a package, or as a plain directory on sys.path
    from .multiproc import DistPools
except ImportError:
    from multiproc import DistPools


@pytest.fixture(scope="session")
def gloo():
    """gloo.run(world_size, fn, *args) runs fn(rank, world_size, *args) on gloo ranks."""
    pools = DistPools()
    yield pools
    pools.close()
