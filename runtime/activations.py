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


ACTIVATIONS = {
    "silu": F.silu,
    "gelu": gelu,
    "gelu_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "relu": F.relu,
    "squared_relu": squared_relu,
}


def glu(*x: torch.Tensor, activation: str) -> torch.Tensor:
    """A gated unit: act(gate) * up, from one [gate | up] value (halved along the last dim, as
    swiglu) or from two values gate, up. A column-parallel gate+up projection is sharded per
    segment, so its local output is [gate_local | up_local] and this works on shards unchanged."""
    if activation not in ACTIVATIONS:
        raise ValueError(f"glu activation must be one of {sorted(ACTIVATIONS)}, got {activation!r}")
    if len(x) == 1:
        if x[0].shape[-1] % 2 != 0:
            raise ValueError(f"glu needs an even last dim, got {x[0].shape[-1]}")
        gate, up = x[0].chunk(2, dim=-1)
    elif len(x) == 2:
        gate, up = x
    else:
        raise ValueError(f"glu takes [gate | up] or gate, up; got {len(x)} tensors")
    return ACTIVATIONS[activation](gate) * up


def scale(x: torch.Tensor, factor: float) -> torch.Tensor:
    """x * factor, the factor rounded to x's dtype first (as Hugging Face Gemma scales its
    embeddings by sqrt(hidden) held in the activation dtype)."""
    return x * torch.tensor(factor, dtype=x.dtype, device=x.device)


def softcap(x: torch.Tensor, cap: float) -> torch.Tensor:
    """cap * tanh(x / cap): values bounded smoothly to (-cap, cap) (Gemma 2's logits and
    attention scores), computed in Hugging Face's order."""
    return torch.tanh(x / cap) * cap


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
