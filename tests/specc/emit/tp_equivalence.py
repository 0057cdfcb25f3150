"""Run a spec compiled at TP=world on gloo ranks and return what must match TP=1: the loss, the
full gradients and the full initial weights. A top-level module so spawned ranks can import it
(tests/specc/emit is put on sys.path by the tests that use it)."""

from __future__ import annotations

import torch

import specc_torch
from runtime.grads import finalize_model_grads
from runtime.init import gather_full
from runtime.parallel_state import ProcessGroups


def batch(vocab: int, b: int, s: int):
    gen = torch.Generator().manual_seed(0)
    return torch.randint(0, vocab, (b, s), generator=gen), torch.randint(0, vocab, (b, s), generator=gen)


def step(rank: int, world: int, path: str, sp: bool, vocab: int, b: int, s: int) -> dict:
    """One forward and backward at TP=world (world=1: in this process, no torch.distributed)."""
    pg = ProcessGroups.initialize(tp=world) if world > 1 else ProcessGroups.single()
    try:
        model = specc_torch.build_model(path, pg, seed=3, sp=sp, dtype="fp32")
        weights = {n: gather_full(p.detach(), p, pg.tp) for n, p in model.named_parameters()}
        replicated = sorted(n for n, p in model.named_parameters() if p._specc_init.shard_dim is None)
        tokens, labels = batch(vocab, b, s)
        loss = model(tokens, labels)
        loss.mean().backward()
        finalize_model_grads(model, pg)
        grads = {n: gather_full(p.grad, p, pg.tp) for n, p in model.named_parameters()}
        return {"loss": loss.detach(), "grads": grads, "weights": weights, "replicated": replicated}
    finally:
        if world > 1:
            pg.destroy()
