"""The layout transforms between a Hugging Face tensor and a specc parameter, per mapping entry:
GPT-2's Conv1D weights are [in, out] (`transpose: true`; the last two dims of stacked experts, Llama
4's [E, in, out]); fused specc weights ([q | k | v], [gate | up]) split into / joined from one HF
tensor per segment; per-group rows ([q_h | k_h | v_h]) regrouped into sections (`permute`); rotary
q/k rows permuted when the HF layout is interleaved (specc's rotary op rotates halves)."""

from __future__ import annotations

import dataclasses

import torch

from specc.errors import SpecError

from .files import HFError
from .mapping import Mapping


def interleaved_to_half(t: torch.Tensor, head_dim: int, rotary_dim: int | None = None) -> torch.Tensor:
    """The first rotary_dim rows of each head (all, by default) from (x0, y0, x1, y1, ...) to
    (x0, x1, ..., y0, y1, ...); the rows that do not rotate stay where they are."""
    r = rotary_dim or head_dim
    heads = t.reshape(t.shape[0] // head_dim, head_dim, *t.shape[1:])
    turned = heads[:, :r].reshape(heads.shape[0], r // 2, 2, *t.shape[1:]).transpose(1, 2)
    return torch.cat([turned.reshape(heads.shape[0], r, *t.shape[1:]), heads[:, r:]], dim=1).reshape(t.shape)


def half_to_interleaved(t: torch.Tensor, head_dim: int, rotary_dim: int | None = None) -> torch.Tensor:
    r = rotary_dim or head_dim
    heads = t.reshape(t.shape[0] // head_dim, head_dim, *t.shape[1:])
    turned = heads[:, :r].reshape(heads.shape[0], 2, r // 2, *t.shape[1:]).transpose(1, 2)
    return torch.cat([turned.reshape(heads.shape[0], r, *t.shape[1:]), heads[:, r:]], dim=1).reshape(t.shape)


def with_rotary(mapping: Mapping, graph, spec_name: str) -> Mapping:
    """The mapping with the rotary features its interleaved permutation covers, read from the
    spec's rotary ops: their head_dim must be the mapping's, and their rotary_dim is what turns
    (a partial rotary op under a whole-head permutation imported GPT-J off by 0.53)."""
    if mapping.rotary_layout != "interleaved":
        return mapping
    from specc.ops import OPS

    rotary = OPS["rotary"]
    dims = sorted({(op.attrs["head_dim"], rotary.rotary_dim(op.attrs)) for op in graph.iter_ops() if op.kind == "rotary"})
    if not dims:
        raise HFError(f"spec {spec_name}: hf.rotary says layout interleaved, but the spec has no rotary op "
                      "(drop hf.rotary)")
    if len(dims) > 1:
        raise HFError(f"spec {spec_name}: its rotary ops rotate different features ({dims}), which one hf.rotary "
                      "permutation cannot cover")
    head_dim, rotary_dim = dims[0]
    if mapping.rotary_head_dim != head_dim:
        raise HFError(f"spec {spec_name}: hf.rotary.head_dim is {mapping.rotary_head_dim}, but its rotary ops' "
                      f"head_dim is {head_dim}")
    return dataclasses.replace(mapping, rotary_dim=rotary_dim)


def grouped_to_sections(t: torch.Tensor, groups: int, sections: tuple) -> torch.Tensor:
    """Rows from `groups` groups of [s0 | s1 | ...] (GPT-NeoX's per-head [q_h | k_h | v_h],
    Megatron's per-query-group layout) to [all s0 | all s1 | ...], group order kept in each."""
    per_group = t.reshape(groups, sum(sections), *t.shape[1:])
    return torch.cat([p.reshape(groups * n, *t.shape[1:]) for p, n in zip(per_group.split(list(sections), dim=1),
                                                                          sections)], dim=0)


def sections_to_grouped(t: torch.Tensor, groups: int, sections: tuple) -> torch.Tensor:
    pieces = [p.reshape(groups, n, *t.shape[1:]) for p, n in zip(t.split([groups * n for n in sections], dim=0),
                                                                 sections)]
    return torch.cat(pieces, dim=1).reshape(t.shape)


def check_permute(t: torch.Tensor, entry, hf_name: str, where: str) -> None:
    groups, sections = entry.permute
    if t.dim() == 0 or t.shape[0] != groups * sum(sections):
        raise HFError(f"{where}: {hf_name} has {t.shape[0] if t.dim() else 0} rows, but its permute needs "
                      f"{groups} groups of {sum(sections)} = {groups * sum(sections)}")


def to_specc(t: torch.Tensor, mapping: Mapping, transpose: bool, rotary: bool, permute=None) -> torch.Tensor:
    if transpose:  # the last two dims: [in, out] matrices, or stacked experts [E, in, out] (Llama 4's)
        t = t.transpose(-2, -1)
    if permute is not None:
        t = grouped_to_sections(t, *permute)
    if rotary and mapping.rotary_layout == "interleaved":
        t = interleaved_to_half(t, mapping.rotary_head_dim, mapping.rotary_dim)
    return t


def to_hf(t: torch.Tensor, mapping: Mapping, transpose: bool, rotary: bool, permute=None) -> torch.Tensor:
    if rotary and mapping.rotary_layout == "interleaved":
        t = half_to_interleaved(t, mapping.rotary_head_dim, mapping.rotary_dim)
    if permute is not None:
        t = sections_to_grouped(t, *permute)
    if transpose:
        t = t.transpose(-2, -1)
    return t.contiguous().clone()  # its own storage: safetensors refuses tensors that share memory


def expert_count(name: str, meta, entry) -> int:
    """How many per-expert tensors an entry with {e} stacks: the parameter's expert dim (0)."""
    if not entry.experts:
        return 1
    if meta.expert_dim != 0:
        raise SpecError(entry.loc, f"'{name}' is not a stacked expert weight, but its hf names have {{e}}",
                        "{e} stacks per-expert tensors into a parameter whose dim 0 holds the experts")
    return meta.full_shape[0]


def segments(name: str, meta, entry, count: int) -> tuple:
    if meta.shard_dim is None or len(meta.segments) != count:
        have = f"segments {list(meta.segments)}" if meta.shard_dim is not None else "no segments"
        raise SpecError(entry.loc, f"'{name}' has {have}, but the hf mapping names {count} tensors for it",
                        "give one hf name per segment, in segment order")
    return meta.shard_dim, list(meta.segments)
