"""Layout boundaries as autograd functions (see docs/architecture.md, "Layouts").

Each wrapper takes the Group explicitly and is the identity when group.size == 1.
Collectives never run in place on their argument: an autograd input or gradient
may be shared with another branch of the graph.
"""

from __future__ import annotations

import torch

from . import comm
from .context_parallel import gather_load_balanced, split_load_balanced
from .parallel_state import Group

# ---------------------------------------------------------------------------
# Tensor-level helpers (no autograd); also used by layers, init and cross-entropy.


def split_dim0(x: torch.Tensor, group: Group) -> torch.Tensor:
    """This rank's chunk of dim 0 (a copy, so later in-place ops are safe)."""
    _check_divisible(x.shape[0], group, "dim 0")
    return x.chunk(group.size, dim=0)[group.rank].clone()


def gather_dim0(x: torch.Tensor, group: Group) -> torch.Tensor:
    out = x.new_empty((x.shape[0] * group.size, *x.shape[1:]))
    comm.all_gather_into_tensor(out, x.contiguous(), group)
    return out


def reduce_scatter_dim0(x: torch.Tensor, group: Group) -> torch.Tensor:
    _check_divisible(x.shape[0], group, "dim 0")
    out = x.new_empty((x.shape[0] // group.size, *x.shape[1:]))
    comm.reduce_scatter_tensor(out, x.contiguous(), group)
    return out


def all_reduce_copy(x: torch.Tensor, group: Group) -> torch.Tensor:
    out = x.clone(memory_format=torch.contiguous_format)
    comm.all_reduce(out, group)
    return out


def split_last(x: torch.Tensor, group: Group) -> torch.Tensor:
    _check_divisible(x.shape[-1], group, "the last dim")
    return x.chunk(group.size, dim=-1)[group.rank].contiguous()


def gather_last(x: torch.Tensor, group: Group) -> torch.Tensor:
    # Collectives concatenate along dim 0: gather to [t * s, ...], view it as
    # [t, s, ..., h], move the rank axis next to the last dim and merge: [s, ..., t * h].
    stacked = gather_dim0(x, group).view(group.size, *x.shape)
    return stacked.movedim(0, -2).reshape(*x.shape[:-1], group.size * x.shape[-1])


def split_last_segments(x: torch.Tensor, group: Group, segments) -> torch.Tensor:
    """This rank's slice of every segment of the last dim (full sizes `segments`, e.g. a fused
    [q | k | v]), concatenated: [q_r | k_r | v_r], as a segmented column-parallel GEMM makes it."""
    if sum(segments) != x.shape[-1]:
        raise ValueError(f"segments {list(segments)} do not sum to the last dim {x.shape[-1]}")
    for n in segments:
        _check_divisible(n, group, "a segment of the last dim")
    return torch.cat([p.chunk(group.size, dim=-1)[group.rank] for p in x.split(list(segments), dim=-1)],
                     dim=-1).contiguous()


def gather_last_segments(x: torch.Tensor, group: Group, segments) -> torch.Tensor:
    """The inverse of split_last_segments: each rank holds [q_r | k_r | v_r]; the full value is
    [q_0 .. q_t-1 | k_0 .. | v_0 ..] (one all-gather, then the segments put back in order)."""
    local = [n // group.size for n in segments]
    if sum(local) != x.shape[-1]:
        raise ValueError(f"local segments {local} do not sum to the last dim {x.shape[-1]}")
    stacked = gather_dim0(x, group).view(group.size, *x.shape)  # [t, ..., h/t]
    parts = [p.movedim(0, -2).reshape(*x.shape[:-1], group.size * n) for p, n in zip(stacked.split(local, dim=-1), local)]
    return torch.cat(parts, dim=-1)


def _check_divisible(n: int, group: Group, what: str) -> None:
    if n % group.size != 0:
        raise ValueError(
            f"{what} of size {n} is not divisible by the {group.name!r} group size {group.size}"
        )


# ---------------------------------------------------------------------------
# Autograd functions; the Group argument gets no gradient.


class _CopyToTensorModelParallelRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return all_reduce_copy(grad, ctx.group), None


class _ReduceFromTensorModelParallelRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        return all_reduce_copy(x, group)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _GatherFromSequenceParallelRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, tensor_parallel_output_grad):
        ctx.group = group
        ctx.tensor_parallel_output_grad = tensor_parallel_output_grad
        return gather_dim0(x, group)

    @staticmethod
    def backward(ctx, grad):
        if ctx.tensor_parallel_output_grad:
            return reduce_scatter_dim0(grad, ctx.group), None, None
        return split_dim0(grad, ctx.group), None, None


class _ReduceScatterToSequenceParallelRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return reduce_scatter_dim0(x, group)

    @staticmethod
    def backward(ctx, grad):
        return gather_dim0(grad, ctx.group), None


class _ScatterToSequenceParallelRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return split_dim0(x, group)

    @staticmethod
    def backward(ctx, grad):
        return gather_dim0(grad, ctx.group), None


def _gather_last(x, group, segments):
    return gather_last(x, group) if segments is None else gather_last_segments(x, group, segments)


def _split_last(x, group, segments):
    return split_last(x, group) if segments is None else split_last_segments(x, group, segments)


class _GatherFromTensorModelParallelRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, segments):
        ctx.group, ctx.segments = group, segments
        return _gather_last(x, group, segments)

    @staticmethod
    def backward(ctx, grad):
        return _split_last(grad, ctx.group, ctx.segments), None, None


class _ScatterToTensorModelParallelRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, segments):
        ctx.group, ctx.segments = group, segments
        return _split_last(x, group, segments)

    @staticmethod
    def backward(ctx, grad):
        return _gather_last(grad, ctx.group, ctx.segments), None, None


# ---------------------------------------------------------------------------
# Public wrappers (Megatron's names).


def copy_to_tensor_model_parallel_region(x: torch.Tensor, group: Group) -> torch.Tensor:
    """I -> R: forward identity, backward all-reduce."""
    if group.size == 1:
        return x
    return _CopyToTensorModelParallelRegion.apply(x, group)


def reduce_from_tensor_model_parallel_region(x: torch.Tensor, group: Group) -> torch.Tensor:
    """P -> I: forward all-reduce, backward identity."""
    if group.size == 1:
        return x
    return _ReduceFromTensorModelParallelRegion.apply(x, group)


def gather_from_sequence_parallel_region(
    x: torch.Tensor, group: Group, tensor_parallel_output_grad: bool = True
) -> torch.Tensor:
    """S(s) -> R (backward reduce-scatter), or S(s) -> I when
    tensor_parallel_output_grad is False (backward split)."""
    if group.size == 1:
        return x
    return _GatherFromSequenceParallelRegion.apply(x, group, tensor_parallel_output_grad)


def reduce_scatter_to_sequence_parallel_region(x: torch.Tensor, group: Group) -> torch.Tensor:
    """P -> S(s): forward reduce-scatter dim 0, backward all-gather dim 0."""
    if group.size == 1:
        return x
    return _ReduceScatterToSequenceParallelRegion.apply(x, group)


def scatter_to_sequence_parallel_region(x: torch.Tensor, group: Group) -> torch.Tensor:
    """I -> S(s): forward keep this rank's dim-0 chunk, backward all-gather dim 0."""
    if group.size == 1:
        return x
    return _ScatterToSequenceParallelRegion.apply(x, group)


def gather_from_tensor_model_parallel_region(x: torch.Tensor, group: Group, segments=None) -> torch.Tensor:
    """S(h) -> I: forward all-gather the last dim, backward split the last dim. `segments`: the
    full sizes of a fused value's parts (e.g. [q, k, v]), each sharded on its own."""
    if group.size == 1:
        return x
    return _GatherFromTensorModelParallelRegion.apply(x, group, tuple(segments) if segments else None)


def scatter_to_tensor_model_parallel_region(x: torch.Tensor, group: Group, segments=None) -> torch.Tensor:
    """I -> S(h): forward split the last dim, backward all-gather the last dim; `segments` as
    for the gather (each rank keeps its slice of every segment)."""
    if group.size == 1:
        return x
    return _ScatterToTensorModelParallelRegion.apply(x, group, tuple(segments) if segments else None)


# ---------------------------------------------------------------------------
# Context parallelism: the sequence in load-balanced order over the cp group
# (runtime/context_parallel.py). dim is 0 for [s, b, h] activations, 1 for [b, s]
# token ids, labels and per-token losses. Forward works on integer tensors too.


class _ScatterToContextParallelRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, dim):
        ctx.group, ctx.dim = group, dim
        return split_load_balanced(x, group, dim)

    @staticmethod
    def backward(ctx, grad):
        return gather_load_balanced(grad, ctx.group, ctx.dim), None, None


class _GatherFromContextParallelRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, dim):
        ctx.group, ctx.dim = group, dim
        return gather_load_balanced(x, group, dim)

    @staticmethod
    def backward(ctx, grad):
        return split_load_balanced(grad, ctx.group, ctx.dim), None, None


def scatter_to_context_parallel_region(x: torch.Tensor, group: Group, dim: int = 0) -> torch.Tensor:
    """Natural order -> this CP rank's chunks (r, 2N-1-r) along `dim`: forward keep them
    (no communication), backward all-gather along `dim` and restore the natural order."""
    if group.size == 1:
        return x
    return _ScatterToContextParallelRegion.apply(x, group, dim)


def gather_from_context_parallel_region(x: torch.Tensor, group: Group, dim: int = 0) -> torch.Tensor:
    """This CP rank's chunks -> the full sequence in natural order: forward all-gather along
    `dim` and un-permute, backward keep this rank's chunks (no communication)."""
    if group.size == 1:
        return x
    return _GatherFromContextParallelRegion.apply(x, group, dim)
