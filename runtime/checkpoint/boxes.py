"""Where a rank's tensors sit inside the full, layout-independent tensors a checkpoint stores.

A checkpoint stores every parameter (and every per-parameter optimizer tensor) at its FULL shape
under a layout-independent name. A rank holds some rectangular blocks ("boxes") of it:

- a parameter's TP shard: one box per fused segment, because segments ([q | k | v], [gate | up])
  are sharded one by one, so rank r's local [q/t | k/t | v/t] is three separate blocks of the
  full [q | k | v] (runtime.init.ParamInit: shard_dim, segments, tp_rank, tp_size); a segment of
  fewer heads than TP ranks (units) holds one whole head per rank, the same box on its replicas;
- a DP shard of a flat buffer (the distributed optimizer): a contiguous range of the row-major
  flattening of the local TP shard, which is a few row blocks, each then split by segment.

Each box is (offsets in the full tensor, a view of the rank's own tensor holding that block), so
saving writes the views and loading copies into them: the rank's tensors are filled in place.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from ..init import ParamInit

Box = tuple  # (offsets: tuple[int, ...], view: torch.Tensor)


@dataclass
class Boxes:
    """The part of one full-shape tensor this rank holds."""

    shape: tuple  # the full shape
    dtype: torch.dtype
    boxes: list = field(default_factory=list)  # [(offsets, view), ...]

    def numel(self) -> int:
        return sum(view.numel() for _, view in self.boxes)


def _segment_ranges(meta: ParamInit):
    """(local start, full start, size) along shard_dim of each segment's piece on this rank. A
    unit (head) replicated over several ranks is the same box on each: DCP saves it once (its
    deduplication of identical chunks) and loads it on every replica."""
    return [(local, full, n) for local, full, n, _ in meta.pieces()]


def local_to_full(offsets, sizes, meta: ParamInit | None) -> list:
    """A block [offsets, offsets + sizes) of the LOCAL shard as blocks of the FULL tensor:
    [(local offsets, sizes, full offsets), ...] (split where it crosses segments)."""
    offsets, sizes = tuple(offsets), tuple(sizes)
    out = _local_to_full_tp(offsets, sizes, meta)
    if meta is not None and meta.expert_dim is not None and meta.ep_size > 1:
        # this rank's experts are a contiguous block of the full expert dim
        e, first = meta.expert_dim, meta.ep_rank * (meta.full_shape[meta.expert_dim] // meta.ep_size)
        out = [(loc, size, full[:e] + (full[e] + first,) + full[e + 1:]) for loc, size, full in out]
    return out


def _local_to_full_tp(offsets, sizes, meta: ParamInit | None) -> list:
    if meta is None or meta.shard_dim is None:
        return [(offsets, sizes, offsets)]
    d = meta.shard_dim
    if meta.tp_size == 1:  # the segments are contiguous: local coordinates are full ones
        return [(offsets, sizes, offsets)]
    lo, hi = offsets[d], offsets[d] + sizes[d]
    out = []
    for local, full, n in _segment_ranges(meta):
        a, b = max(lo, local), min(hi, local + n)
        if a >= b:
            continue
        loc = offsets[:d] + (a,) + offsets[d + 1:]
        size = sizes[:d] + (b - a,) + sizes[d + 1:]
        out.append((loc, size, offsets[:d] + (full + a - local,) + offsets[d + 1:]))
    return out


def _narrow(view: torch.Tensor, starts, sizes) -> torch.Tensor:
    for dim, (start, size) in enumerate(zip(starts, sizes)):
        if start != 0 or size != view.shape[dim]:
            view = view.narrow(dim, start, size)
    return view


def param_boxes(local: torch.Tensor, meta: ParamInit | None) -> list:
    """Boxes of a tensor shaped like a parameter's local shard (the parameter itself, or a
    gradient or optimizer tensor of the same shape)."""
    if meta is not None and tuple(local.shape) != meta.local_shape:
        raise ValueError(f"tensor of shape {tuple(local.shape)} is not this rank's shard {meta.local_shape}")
    zero = (0,) * local.dim()
    return [(full, _narrow(local, loc, size)) for loc, size, full in local_to_full(zero, tuple(local.shape), meta)]


def flat_range_blocks(shape, start: int, stop: int) -> list:
    """Elements [start, stop) of the row-major flattening of `shape` as blocks, each contiguous
    in the flattening: [(offsets, sizes, flat offset of the block's first element), ...]."""
    shape = tuple(int(s) for s in shape)
    if start >= stop:
        return []
    if len(shape) == 0:
        return [((), (), 0)]
    if len(shape) == 1:
        return [((start,), (stop - start,), start)]
    inner = math.prod(shape[1:])
    rest = len(shape) - 1
    out = []
    first_full = -(-start // inner)
    if start % inner:  # a partial first row
        row = start // inner
        end = min(stop, (row + 1) * inner)
        for offs, sizes, flat in flat_range_blocks(shape[1:], start - row * inner, end - row * inner):
            out.append(((row,) + offs, (1,) + sizes, flat + row * inner))
        if end == stop:
            return out
    last_full = stop // inner
    if last_full > first_full:
        out.append(((first_full,) + (0,) * rest, (last_full - first_full,) + shape[1:], first_full * inner))
    if stop % inner:  # a partial last row
        row = stop // inner
        for offs, sizes, flat in flat_range_blocks(shape[1:], 0, stop - row * inner):
            out.append(((row,) + offs, (1,) + sizes, flat + row * inner))
    return out


def flat_boxes(flat: torch.Tensor, start: int, meta: ParamInit | None, local_shape) -> list:
    """Boxes of `flat`, a 1-D tensor holding elements [start, start + len) of the row-major
    flattening of a local shard of shape `local_shape`."""
    if flat.dim() != 1:
        raise ValueError(f"a flat shard must be 1-D, got shape {tuple(flat.shape)}")
    total = math.prod(local_shape)
    if start < 0 or start + flat.numel() > total:
        raise ValueError(f"flat range [{start}, {start + flat.numel()}) is outside the shard's {total} elements")
    out = []
    for offs, sizes, first in flat_range_blocks(local_shape, start, start + flat.numel()):
        block = flat[first - start:first - start + math.prod(sizes)].view(sizes)
        for loc, size, full in local_to_full(offs, sizes, meta):
            rel = tuple(a - b for a, b in zip(loc, offs))
            out.append((full, _narrow(block, rel, size)))
    return out
