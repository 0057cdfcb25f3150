"""A rank's piece of a full tensor, by the tensor's layout over the TP group: what the
TP-invariant debug modes (dropout masks drawn full-size) keep on each rank. Below the layers,
attention and context parallelism, which all use it."""

from __future__ import annotations

import torch

from .parallel_state import Group


def local_piece(full: torch.Tensor, layout: str, tp: Group, dim_for_heads: int | None = None) -> torch.Tensor:
    """This rank's piece of a full tensor: rows for S(s), the last dim (or `dim_for_heads`) for S(h)."""
    if tp.size == 1 or layout in ("I", "R", "P"):
        return full
    dim = 0 if layout == "S(s)" else (-1 if dim_for_heads is None else dim_for_heads)
    return full.chunk(tp.size, dim=dim)[tp.rank]
