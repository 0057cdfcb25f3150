"""Shared by the training tests: a small prepared corpus, a gpt-tiny TrainConfig, and a few
steps of the real loop at any parallel setting, returning what the tests compare."""

from __future__ import annotations

import os

import torch

from runtime.data import build_datasets, prepare, stdlib_files
from runtime.init import gather_full
from runtime.parallel_state import ProcessGroups
from runtime.train.config import OptimizerConfig, ParallelConfig, TrainConfig, resolve, split_weights
from runtime.train.training import micro_batch, setup_model_and_optimizer, train_step

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", ".."))
GPT_TINY = os.path.join(ROOT, "specs", "gpt-tiny.yaml")


def make_corpus(directory: str) -> str:
    """Twelve standard-library files, byte-tokenized (about 300k tokens)."""
    out = os.path.join(directory, "corpus")
    prepare(stdlib_files(limit=12), "byte", out)
    return out


def tiny_config(world: int, data: str, *, tp=1, sp=False, mbs=2, gbs=8, dist_opt=False, clip=1.0, lr=3e-3,
                bucket=4_000_000, bf16=False, **kw) -> TrainConfig:
    cfg = TrainConfig(spec=GPT_TINY, parallel=ParallelConfig(tp=tp, sp=sp), micro_batch_size=mbs,
                      global_batch_size=gbs, bf16=bf16,
                      optimizer=OptimizerConfig(lr=lr, clip_grad=clip, use_distributed_optimizer=dist_opt,
                                                bucket_size=bucket), **kw)
    cfg.data.data_path = data
    errors = resolve(cfg, world)
    assert errors == [], errors
    return cfg


def run_steps(cfg: TrainConfig, pg: ProcessGroups, steps: int, lrs=None):
    """`steps` iterations of train_step; returns (losses, grad norms, full parameters by name)."""
    setup = setup_model_and_optimizer(cfg, pg)
    data = build_datasets(cfg.data.data_path, setup.spec.config["seq_length"], cfg.seed, split_weights(cfg.data.split))
    losses, norms, consumed = [], [], 0
    for it in range(1, steps + 1):
        batches = [micro_batch(data["train"], consumed, m, cfg, pg, setup.device) for m in range(cfg.num_micro_batches)]
        lr = lrs[it - 1] if lrs is not None else cfg.optimizer.lr
        result = train_step(setup, batches, lr, pg, cfg.bf16)
        losses.append(result.loss)
        norms.append(result.grad_norm)
        consumed += cfg.global_batch_size
    params = {name: gather_full(p, p, pg.tp).float() for name, p in setup.model.named_parameters()}
    return losses, norms, params, setup


def assert_params_close(a: dict, b: dict, rtol=1e-4, atol=1e-5) -> None:
    assert a.keys() == b.keys()
    for name in a:
        torch.testing.assert_close(a[name], b[name], rtol=rtol, atol=atol, msg=lambda m, n=name: f"{n}: {m}")
