"""Rules the compiler and the runtime both hold, each side stating its own once (neither may import
the other): the CP ring's chunk pair, the collective kinds, and the boundary table's functions."""

import torch

from runtime import comm, mappings
from runtime.context_parallel import _positions
from runtime.sharding import chunk_pair
from specc.layouts import BOUNDARIES, COLLECTIVES, cp_chunk_pair


def test_cp_chunk_pair_agrees():
    for n in range(1, 6):
        held = []
        for rank in range(n):
            assert cp_chunk_pair(n, rank) == chunk_pair(n, rank)
            held += cp_chunk_pair(n, rank)
            c = 3  # the runtime's token positions are the compiler's chunks, in its order
            want = torch.cat([torch.arange(k * c, (k + 1) * c) for k in cp_chunk_pair(n, rank)])
            assert torch.equal(_positions(2 * c, n, rank), want)
        assert sorted(held) == list(range(2 * n))  # the ranks' pairs cut the sequence once


def test_collectives_and_boundaries_agree():
    assert sorted(COLLECTIVES) == sorted(comm.KINDS)
    for boundary in BOUNDARIES.values():
        assert callable(getattr(mappings, boundary.function, None)), boundary.function
        for collective in (boundary.forward, boundary.backward):
            assert collective in ("", "split") or collective in comm.KINDS, (boundary.label, collective)
