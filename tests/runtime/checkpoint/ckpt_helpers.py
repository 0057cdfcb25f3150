"""Shared by the checkpoint tests, here and in spawned gloo ranks: models with known full
weights, batches by position, and a distributed-optimizer-like flat state (ZeRO-1 layout)."""

from __future__ import annotations

import hashlib
import os

import torch

import runtime
import specc_torch
from runtime.checkpoint import flat_param_shards
from runtime.init import local_slice

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
GPT = os.path.join(ROOT, "specs", "gpt-tiny.yaml")
LLAMA = os.path.join(ROOT, "specs", "llama-tiny.yaml")


def _generator(name: str, salt: str) -> torch.Generator:
    digest = hashlib.sha256(f"{salt}:{name}".encode()).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") >> 1)


def full_value(name: str, shape, salt: str = "weights") -> torch.Tensor:
    """A full tensor that depends only on (name, salt): the same at every layout."""
    return torch.randn(tuple(shape), generator=_generator(name, salt)) * 0.05


def _meta(p):
    return p._specc_init


@torch.no_grad()
def set_weights(model, salt: str = "weights") -> None:
    """Every parameter := this rank's slice of full_value(name) (not an init any seed gives)."""
    for name, p in model.named_parameters():
        p.copy_(local_slice(full_value(name, _meta(p).full_shape, salt), _meta(p)))


def expected_weights(spec: str, salt: str = "weights", **kw) -> dict:
    model = specc_torch.build_model(spec, seed=0, **kw)
    set_weights(model, salt)
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def full_weights(model, pg) -> dict:
    return {n: runtime.gather_full(p, p, pg.tp) for n, p in model.named_parameters()}


def batch(position: int, b: int = 2, s: int = 32, vocab: int = 256):
    """Global sample `position`'s tokens and labels: data is addressed by position only."""
    g = torch.Generator().manual_seed(1000 + position)
    tokens = torch.randint(0, vocab, (b, s + 1), generator=g)
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


def loss_of(model, position: int = 0) -> torch.Tensor:
    tokens, labels = batch(position)
    return model(tokens, labels).mean()


class FlatState:
    """A distributed optimizer's state in small: one fp32 value per element of this TP rank's
    parameters, laid out flat in registration order (padded to the DP size), and this DP rank
    holding only its 1/DP range, as runtime.optim's distributed Adam does."""

    def __init__(self, model, pg):
        self.param_range, offset = {}, 0
        for _, p in model.named_parameters():
            self.param_range[p] = (offset, offset + p.numel())
            offset += p.numel()
        padded = -(-offset // pg.dp.size) * pg.dp.size
        size = padded // pg.dp.size
        self.lo, self.hi = pg.dp.rank * size, (pg.dp.rank + 1) * size
        self.exp_avg = torch.zeros(size)
        self.model = model

    def shards(self) -> dict:
        return flat_param_shards(self.model, self.param_range, self.lo, self.hi, self.exp_avg)

    @torch.no_grad()
    def fill_expected(self) -> None:
        """exp_avg := the DP range of full_value(name, salt='exp_avg') sliced to this TP rank."""
        for name, shard in self.shards().items():
            p = dict(self.model.named_parameters())[name]
            local = local_slice(full_value(name, _meta(p).full_shape, "exp_avg"), _meta(p)).reshape(-1)
            shard.tensor.copy_(local[shard.start:shard.start + shard.tensor.numel()])

    def matches_expected(self) -> bool:
        mine = self.exp_avg.clone()
        self.fill_expected()
        same = torch.equal(mine, self.exp_avg)
        self.exp_avg.copy_(mine)
        return same
