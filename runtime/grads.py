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
    whose reduce-scatter leaves each stage only its own shard (the two sums commute)."""
    _allreduce_tied_grads(model, pg)
    if ddp is not None:
        ddp.finish_grad_sync()
    for axis in _AXES:
        _allreduce_partial_grads(model, getattr(pg, axis), axis)


def _allreduce_partial_grads(model: torch.nn.Module, group: Group, axis: str) -> None:
    """Sum the parameters' gradients tagged partial on `axis` over its group, in one flat
    buffer per dtype (one collective in the usual single-dtype model)."""
    if group.size == 1:
        return
    params = [p for p in model.parameters() if p.requires_grad and axis in partial_grad_axes(p)]
    by_dtype: dict[torch.dtype, list[torch.nn.Parameter]] = {}
    for p in params:
        by_dtype.setdefault(p.dtype, []).append(p)
    for dtype in sorted(by_dtype, key=str):  # same order on every rank
        tagged = by_dtype[dtype]
        # A parameter with no gradient on this rank contributes zeros, so every
        # rank reduces the same buffer size and none waits on a mismatch.
        grads = [_grad_of(p) for p in tagged]
        flat = torch.cat([g.reshape(-1) for g in grads])
        comm.all_reduce(flat, group)
        for p, reduced in zip(tagged, flat.split([g.numel() for g in grads])):
            reduced = reduced.view_as(p)
            if hasattr(p, "main_grad"):  # DistributedDataParallel's fp32 buffer
                p.main_grad.copy_(reduced)
            elif p.grad is None:
                p.grad = reduced.clone()
            else:
                p.grad.copy_(reduced)


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
