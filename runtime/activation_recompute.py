"""Activation recompute (Megatron's `tensor_parallel.checkpoint`): run a layer, a group of
layers or the attention core without keeping what its backward needs, keep only its inputs, and
run its forward again in backward. torch.utils.checkpoint (non-reentrant) does the work; this adds
what Megatron's CheckpointFunction adds: the RNGTracker's streams (tensor-parallel dropout) are
replayed, so the recompute draws the masks the forward drew, and recompute is exact."""

from __future__ import annotations

import contextlib

import torch
from torch.utils.checkpoint import checkpoint, set_checkpoint_early_stop

from .random import RNGTracker


def recompute(function, *args, rng_tracker: RNGTracker | None = None):
    """`function(*args)`, keeping only `args` for backward (function: a module, or a sequence of
    single-input modules applied in turn, e.g. a slice of the layers). torch's checkpoint saves and
    restores the default generator; the tracker's streams are snapshotted here and replayed in the
    recompute. The whole forward runs again (early stop off): the collectives it issues run twice
    on every rank, as the plan counts them."""
    if isinstance(function, (list, tuple, torch.nn.ModuleList, torch.nn.Sequential)):
        function = _Chain(function)
    if not torch.is_grad_enabled():  # nothing is kept without autograd: run it once
        return function(*args)

    def contexts():
        replay = rng_tracker.replaying(rng_tracker.snapshot()) if rng_tracker is not None else contextlib.nullcontext()
        return contextlib.nullcontext(), _recomputing_block(replay)

    with set_checkpoint_early_stop(False):
        return checkpoint(function, *args, use_reentrant=False, preserve_rng_state=True, context_fn=contexts)


_RECOMPUTING = [0]  # recomputes in progress (nested checkpoints recompute inside one another)


def recomputing() -> bool:
    """True while a recompute runs a forward again: state a forward accumulates (the MoE router's
    token counts for bias balancing) must count the first run only."""
    return _RECOMPUTING[0] > 0


@contextlib.contextmanager
def _recomputing_block(inner):
    _RECOMPUTING[0] += 1
    try:
        with inner:
            yield
    finally:
        _RECOMPUTING[0] -= 1


class _Chain:
    """Layers applied one after another: one recomputed region for several layers."""

    def __init__(self, layers):
        self.layers = list(layers)

    def __call__(self, x, *rest):
        for layer in self.layers:  # side inputs (a padding mask) reach every layer
            x = layer(x, *rest)
        return x
