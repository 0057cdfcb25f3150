"""Elementwise activations and last-dim splits used by generated modules."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def gelu(x: torch.Tensor, approximate: str = "none") -> torch.Tensor:
    """GELU: exact (erf), or approximate="tanh" (GPT-2's gelu_new, HF's gelu_pytorch_tanh)."""
    return F.gelu(x, approximate=approximate)


def squared_relu(x: torch.Tensor) -> torch.Tensor:
    """relu(x)^2 (Primer; Megatron's squared_relu)."""
    return torch.pow(F.relu(x), 2)


def glu(*x: torch.Tensor, activation: str) -> torch.Tensor:
    """A gated unit: act(gate) * up, from one [gate | up] value (halved along the last dim, as
    swiglu) or from two values gate, up. A column-parallel gate+up projection is sharded per
    segment, so its local output is [gate_local | up_local] and this works on shards unchanged."""
    if activation not in PLAIN:
        raise ValueError(f"glu activation must be one of {sorted(PLAIN)}, got {activation!r}")
    if len(x) == 1:
        if x[0].shape[-1] % 2 != 0:
            raise ValueError(f"glu needs an even last dim, got {x[0].shape[-1]}")
        gate, up = x[0].chunk(2, dim=-1)
    elif len(x) == 2:
        gate, up = x
    else:
        raise ValueError(f"glu takes [gate | up] or gate, up; got {len(x)} tensors")
    return PLAIN[activation](gate) * up


def scale(x: torch.Tensor, factor: float) -> torch.Tensor:
    """x * factor, the factor rounded to x's dtype first (as Hugging Face Gemma scales its
    embeddings by sqrt(hidden) held in the activation dtype)."""
    return x * torch.tensor(factor, dtype=x.dtype, device=x.device)


def softcap(x: torch.Tensor, cap: float) -> torch.Tensor:
    """cap * tanh(x / cap): values bounded smoothly to (-cap, cap) (Gemma 2's logits and
    attention scores), computed in Hugging Face's order."""
    return torch.tanh(x / cap) * cap


def clamp(x: torch.Tensor, bound: float) -> torch.Tensor:
    """x clamped to [-bound, bound] (MPT's clip_qkv): its gradient passes where x is within."""
    return x.clamp(min=-bound, max=bound)


def swiglu(x: torch.Tensor) -> torch.Tensor:
    """x = [gate | up] along the last dim -> silu(gate) * up.

    A column-parallel gate+up projection is sharded per segment, so its local
    output is [gate_local | up_local] and this works on shards unchanged.
    """
    if x.shape[-1] % 2 != 0:
        raise ValueError(f"swiglu needs an even last dim, got {x.shape[-1]}")
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


# The activations by name, one table that the layers and the MoE experts read; the compiler holds
# the matching one (specc/ops/activations.py) and tests/test_activation_registry.py checks that the
# two agree. PLAIN: on one tensor. GATED: over a last dim laid out [gate | up], each with the
# plain activation it applies to the gate (a projection feeding one is twice as wide).
PLAIN = {
    "silu": F.silu,
    "gelu": gelu,
    "gelu_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "relu": F.relu,
    "squared_relu": squared_relu,
}
GATED = {"swiglu": (swiglu, "silu")}
ACTIVATIONS = {**PLAIN, **{name: fn for name, (fn, _) in GATED.items()}}


def split(x: torch.Tensor, sections, heads: int = 0) -> tuple[torch.Tensor, ...]:
    """Split the last dim into the given local sizes (e.g. a fused QKV output); with `heads` (the
    local head count), each of the heads is split into the sections (MLA's per-head [nope | rope])
    and output i holds every head's section i."""
    sections = [int(s) for s in sections]
    if not heads:
        if sum(sections) != x.shape[-1]:
            raise ValueError(f"split sections {sections} sum to {sum(sections)}, but the last dim is {x.shape[-1]}")
        return tuple(torch.split(x, sections, dim=-1))
    if heads * sum(sections) != x.shape[-1]:
        raise ValueError(f"split: {heads} heads of sections {sections} need a last dim of "
                         f"{heads * sum(sections)}, got {x.shape[-1]}")
    pieces = torch.split(x.unflatten(-1, (heads, sum(sections))), sections, dim=-1)
    return tuple(p.flatten(-2) for p in pieces)


def concat(*xs: torch.Tensor, heads: int = 0) -> torch.Tensor:
    """Join along the last dim; with `heads` (the local head count), head by head: head h of the
    output is [head h of xs[0] | head h of xs[1] | ...] (MLA's per-head [nope | rope])."""
    if not heads:
        return torch.cat(xs, dim=-1)
    for x in xs:
        if x.shape[-1] % heads:
            raise ValueError(f"concat: a last dim of {x.shape[-1]} is not {heads} whole heads")
    return torch.cat([x.unflatten(-1, (heads, x.shape[-1] // heads)) for x in xs], dim=-1).flatten(-2)


def expand_heads(x: torch.Tensor, heads: int) -> torch.Tensor:
    """One head [..., d] repeated as `heads` heads [..., heads * d] (MLA's shared rope key, k_pe,
    given to every query head); backward sums the heads' gradients."""
    return x.unsqueeze(-2).expand(*x.shape[:-1], heads, x.shape[-1]).flatten(-2)
