"""A rank's piece of a full tensor, by the tensor's layout over the TP group: what the
TP-invariant debug modes (dropout masks drawn full-size) keep on each rank; and which chunks of
the sequence a CP rank holds. Below the layers, attention and context parallelism, which all use it."""

from __future__ import annotations

import torch

from .parallel_state import Group


def local_piece(full: torch.Tensor, layout: str, tp: Group, dim_for_heads: int | None = None) -> torch.Tensor:
    """This rank's piece of a full tensor: rows for S(s), the last dim (or `dim_for_heads`) for S(h)."""
    if tp.size == 1 or layout in ("I", "R", "P"):
        return full
    dim = 0 if layout == "S(s)" else (-1 if dim_for_heads is None else dim_for_heads)
    return full.chunk(tp.size, dim=dim)[tp.rank]


def chunk_pair(n: int, rank: int) -> tuple[int, int]:
    """The two of the sequence's 2n chunks CP rank `rank` holds, in its local order: r and 2n-1-r
    (every rank gets one early and one late chunk, so causal attention's work is balanced). The
    runtime's one statement of the rule; the compiler's (specc.layouts.cp_chunk_pair) is checked
    against it by tests/test_shared_rules.py."""
    return rank, 2 * n - 1 - rank
