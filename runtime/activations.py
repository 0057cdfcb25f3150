"""Elementwise activations and last-dim splits used by generated modules."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def gelu(x: torch.Tensor) -> torch.Tensor:
    """Exact (erf) GELU."""
    return F.gelu(x, approximate="none")


def swiglu(x: torch.Tensor) -> torch.Tensor:
    """x = [gate | up] along the last dim -> silu(gate) * up.

    A column-parallel gate+up projection is sharded per segment, so its local
    output is [gate_local | up_local] and this works on shards unchanged.
    """
    if x.shape[-1] % 2 != 0:
        raise ValueError(f"swiglu needs an even last dim, got {x.shape[-1]}")
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


def split(x: torch.Tensor, sections) -> tuple[torch.Tensor, ...]:
    """Split the last dim into the given local sizes (e.g. a fused QKV output)."""
    sections = [int(s) for s in sections]
    if sum(sections) != x.shape[-1]:
        raise ValueError(f"split sections {sections} sum to {sum(sections)}, but the last dim is {x.shape[-1]}")
    return tuple(torch.split(x, sections, dim=-1))
