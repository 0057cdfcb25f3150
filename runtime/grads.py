"""Gradient finalization after backward, before the optimizer step."""

from __future__ import annotations

import torch

from . import comm
from .init import tied_name
from .parallel_state import Group, ProcessGroups

_TP_PARTIAL_ATTR = "_specc_tp_partial_grad"
_PARTIAL_AXES_ATTR = "_specc_partial_grad_axes"
_AXES = ("tp", "cp")  # the mesh axes whose partial gradients finalize_model_grads sums, in order


def mark_tp_partial_grad(param: torch.nn.Parameter) -> torch.nn.Parameter:
    """Tag a replicated parameter used on rank-divergent values (a norm weight in a
    sequence-parallel region, a row-parallel bias added to S(s)): each TP rank then
    holds only part of its gradient, which finalize_model_grads sums."""
    return mark_partial_grad(param, "tp")


def mark_partial_grad(param: torch.nn.Parameter, *axes: str) -> torch.nn.Parameter:
    """Tag a parameter whose gradient is partial over the named mesh axes: used on values
    sharded over the sequence there (S(s) on tp with SP, on cp with context parallelism), each
    rank holds the gradient of its own tokens, which finalize_model_grads sums per axis."""
    unknown = [a for a in axes if a not in _AXES]
    if unknown or not axes:
        raise ValueError(f"partial-gradient axes must be among {_AXES}, got {axes}")
    marked = set(getattr(param, _PARTIAL_AXES_ATTR, ())) | set(axes)
    setattr(param, _PARTIAL_AXES_ATTR, tuple(a for a in _AXES if a in marked))
    if "tp" in marked:
        setattr(param, _TP_PARTIAL_ATTR, True)
    return param


def is_tp_partial_grad(param: torch.nn.Parameter) -> bool:
    return getattr(param, _TP_PARTIAL_ATTR, False)


def partial_grad_axes(param: torch.nn.Parameter) -> tuple:
    return getattr(param, _PARTIAL_AXES_ATTR, ())


def finalize_model_grads(model: torch.nn.Module, pg: ProcessGroups, ddp=None) -> None:
    """After backward, before the optimizer step. With a DistributedDataParallel `ddp`, the
    gradients live in its fp32 `main_grad` buffer: first wait for its data-parallel reductions
    (started in buckets during backward; they write the same memory the TP sums below read),
    then sum the TP-partial gradients. The two sums commute, so the order is free. A tied
    embedding/output weight is one Parameter with one gradient, except across pipeline stages:
    there the first and the last stage each hold one, and their gradients are summed over the
    embedding group (Megatron's _allreduce_word_embedding_grads) BEFORE the data-parallel reduction,
    whose reduce-scatter leaves each stage only its own shard (the two sums commute). Heads
    replicated over TP ranks (a column linear's `heads` fewer than the ranks) have partial
    gradients on each replica: they are summed over TP in the TP-partial buffer (_replica_slots)."""
    _allreduce_tied_grads(model, pg)
    if ddp is not None:
        ddp.finish_grad_sync()
    for axis in _AXES:
        _allreduce_partial_grads(model, getattr(pg, axis), axis)


def _allreduce_partial_grads(model: torch.nn.Module, group: Group, axis: str) -> None:
    """Sum the parameters' gradients tagged partial on `axis` over its group, in one flat
    buffer per dtype (one collective in the usual single-dtype model). On tp the same buffer
    also sums the replicated heads' gradients (_replica_slots)."""
    if group.size == 1:
        return
    params = [p for p in model.parameters() if p.requires_grad and axis in partial_grad_axes(p)]
    replicated = [p for p in model.parameters() if p.requires_grad and axis == "tp" and _has_replicas(p)]
    by_dtype: dict[torch.dtype, tuple[list, list]] = {}
    for p in params:
        by_dtype.setdefault(p.dtype, ([], []))[0].append(p)
    for p in replicated:
        by_dtype.setdefault(p.dtype, ([], []))[1].append(p)
    for dtype in sorted(by_dtype, key=str):  # same order on every rank
        tagged, with_replicas = by_dtype[dtype]
        # A parameter with no gradient on this rank contributes zeros, so every
        # rank reduces the same buffer size and none waits on a mismatch.
        grads = [_grad_of(p) for p in tagged]
        slots = [slot for p in with_replicas for slot in _replica_slots(p)]
        flat = torch.cat([g.reshape(-1) for g in grads] + [padded.reshape(-1) for padded, _ in slots])
        comm.all_reduce(flat, group)
        pieces = flat.split([g.numel() for g in grads] + [padded.numel() for padded, _ in slots])
        for p, reduced in zip(tagged, pieces):
            _set_grad(p, reduced.view_as(p))
        for (padded, copy_back), reduced in zip(slots, pieces[len(grads):]):
            copy_back(reduced.view_as(padded))


def _set_grad(p: torch.nn.Parameter, reduced: torch.Tensor) -> None:
    if hasattr(p, "main_grad"):  # DistributedDataParallel's fp32 buffer
        p.main_grad.copy_(reduced)
    elif p.grad is None:
        p.grad = reduced.clone()
    else:
        p.grad.copy_(reduced)


def _has_replicas(p: torch.nn.Parameter) -> bool:
    meta = getattr(p, "_specc_init", None)
    return meta is not None and meta.replicated_units()


def _replica_slots(p: torch.nn.Parameter) -> list:
    """For each segment of p whose heads are replicated over TP ranks: a zero buffer of the whole
    segment with this rank's head written in its slot, and how to copy the summed slot back.
    Summed over TP, slot u is the sum over the replicas of head u of their partial gradients:
    no sub-groups to create, at the price of moving the segment's full size (n heads, n < t)."""
    meta = p._specc_init
    if not hasattr(p, "main_grad") and p.grad is None:  # none reached it here: zeros, to receive the sum
        p.grad = torch.zeros_like(p)
    grad = _grad_of(p)
    out, full_start = [], 0
    for size, (local, start, n, reps) in zip(meta.segments, meta.pieces()):
        if reps > 1:
            padded = grad.new_zeros((size,) + tuple(grad.shape[1:]))
            padded.narrow(0, start - full_start, n).copy_(grad.narrow(0, local, n))
            mine = grad.narrow(0, local, n)
            out.append((padded, lambda summed, mine=mine, at=start - full_start, n=n: mine.copy_(summed.narrow(0, at, n))))
        full_start += size
    return out


def _allreduce_tied_grads(model: torch.nn.Module, pg: ProcessGroups) -> None:
    """Sum the gradients of weights tied across pipeline stages over the embedding group, by name
    (both ends list the same names in the same order)."""
    group = getattr(pg, "embd", None)
    if group is None or group.size == 1:
        return
    tied = sorted(((tied_name(p), p) for p in model.parameters() if tied_name(p) is not None), key=lambda t: t[0])
    for _, p in tied:
        grad = _grad_of(p)
        if hasattr(p, "main_grad") or p.grad is not None:
            comm.all_reduce(grad, group)
        else:
            p.grad = grad
            comm.all_reduce(p.grad, group)


def _grad_of(p: torch.nn.Parameter) -> torch.Tensor:
    if hasattr(p, "main_grad"):
        return p.main_grad
    return p.grad if p.grad is not None else torch.zeros_like(p)
