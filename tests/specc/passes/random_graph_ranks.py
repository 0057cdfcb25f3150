"""What one rank computes for a random graph at some TP x CP size: the per-token loss, the full
gradients and the full weights after one SGD step, from randomized non-trivial weights. A
top-level module so spawned ranks can import it (the test puts this folder on sys.path)."""

from __future__ import annotations

import torch

import specc_torch
from runtime.grads import finalize_model_grads
from runtime.init import gather_full, randomize_parameters
from runtime.parallel_state import ProcessGroups


def inputs(vocab: int, b: int, s: int, names: list) -> list:
    gen = torch.Generator().manual_seed(11)
    return [torch.randint(0, vocab, (b, s), generator=gen) for _ in names]


def step(rank: int, world: int, path: str, tp: int, cp: int, sp: bool, vocab: int, b: int, s: int,
         names: list) -> dict:
    pg = ProcessGroups.initialize(tp=tp, cp=cp) if world > 1 else ProcessGroups.single()
    try:
        model = specc_torch.build_model(path, pg, seed=5, sp=sp, dtype="fp32")
        randomize_parameters(model, seed=5)  # no zero biases, no unit gains: misplaced ones show
        loss = model(*inputs(vocab, b, s, names))
        loss.mean().backward()
        finalize_model_grads(model, pg)
        grads = {n: gather_full(p.grad, p, pg.tp) for n, p in model.named_parameters()}
        with torch.no_grad():
            for p in model.parameters():
                p -= 0.1 * p.grad
        weights = {n: gather_full(p.detach(), p, pg.tp) for n, p in model.named_parameters()}
        return {"loss": loss.detach(), "grads": grads, "weights": weights}
    finally:
        if world > 1:
            pg.destroy()
