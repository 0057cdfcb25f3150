"""Shared by the training tests: a small prepared corpus, a gpt-tiny TrainConfig, and a few
steps of the real loop at any parallel setting, returning what the tests compare."""

from __future__ import annotations

import math
import os

import torch

from runtime import comm
from runtime.data import build_datasets, prepare, stdlib_files
from runtime.init import gather_full, local_slice
from runtime.parallel_state import ProcessGroups
from runtime.train.config import OptimizerConfig, ParallelConfig, TrainConfig, resolve, split_weights
from runtime.train.training import micro_batch, reload_master_weights, setup_model_and_optimizer, train_step
from specc_torch.train_compile import compile_model

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", ".."))
GPT_TINY = os.path.join(ROOT, "specs", "gpt-tiny.yaml")
LLAMA_TINY = os.path.join(ROOT, "specs", "llama-tiny.yaml")


def make_corpus(directory: str) -> str:
    """Twenty standard-library files, byte-tokenized (about 540k tokens; twenty documents, so that
    --split 969,30,1 leaves one for validation)."""
    out = os.path.join(directory, "corpus")
    prepare(stdlib_files(limit=20), "byte", out)
    return out


def tiny_config(world: int, data: str, *, tp=1, sp=False, cp=1, pp=1, ep=1, mbs=2, gbs=8, dist_opt=False, clip=1.0, lr=3e-3,
                bucket=4_000_000, bf16=False, spec=GPT_TINY, **kw) -> TrainConfig:
    cfg = TrainConfig(spec=spec, parallel=ParallelConfig(tp=tp, sp=sp, cp=cp, pp=pp, ep=ep),
                      micro_batch_size=mbs,
                      global_batch_size=gbs, bf16=bf16,
                      optimizer=OptimizerConfig(lr=lr, clip_grad=clip, use_distributed_optimizer=dist_opt,
                                                bucket_size=bucket), **kw)
    cfg.data.data_path = data
    errors = resolve(cfg, world)
    assert errors == [], errors
    return cfg


def run_steps(cfg: TrainConfig, pg: ProcessGroups, steps: int, lrs=None, trace: dict | None = None,
              follow: dict | None = None, on_setup=None):
    """`steps` iterations of train_step; returns (losses, grad norms, full parameters by name, setup).

    trace, a dict, receives per step: "losses", "norms", "before" (the full weights the step
    started from), "grads" (its gradients as the optimizer used them, full_grads) and "after"
    (the full weights after it). follow, another run's trace: every step starts from that run's
    "before" weights, so the two runs' steps compare from the same weights. on_setup(setup) runs
    once before the first step."""
    setup = setup_model_and_optimizer(cfg, pg, compiled=compile_model(cfg))
    if on_setup is not None:
        on_setup(setup)
    data = build_datasets(cfg.data.data_path, setup.spec.config["seq_length"], cfg.seed, split_weights(cfg.data.split))
    record = {"losses": [], "norms": [], "before": [], "grads": [], "after": []}
    consumed = 0
    for it in range(1, steps + 1):
        if follow is not None:
            load_full_weights(setup, follow["before"][it - 1])
        if trace is not None:
            record["before"].append(full_weights(setup.model, pg))
        batches = [micro_batch(data["train"], consumed, m, cfg, pg, setup.device) for m in range(cfg.num_micro_batches)]
        lr = lrs[it - 1] if lrs is not None else cfg.optimizer.lr
        result = train_step(setup, batches, lr, pg, cfg.bf16)
        record["losses"].append(result.loss)
        record["norms"].append(result.grad_norm)
        if trace is not None:
            record["grads"].append(full_grads(setup, pg))
            record["after"].append(full_weights(setup.model, pg))
        consumed += cfg.global_batch_size
    if trace is not None:
        trace.update(record)
    return record["losses"], record["norms"], full_weights(setup.model, pg), setup


def full_weights(model, pg: ProcessGroups) -> dict:
    return {name: gather_full(p, p, pg.tp, pg.ep).float() for name, p in model.named_parameters()}


@torch.no_grad()
def load_full_weights(setup, weights: dict) -> None:
    """Every parameter from full tensors (each rank keeps its slice), masters too."""
    for name, p in setup.model.named_parameters():
        p.copy_(local_slice(weights[name], p._specc_init).to(p.dtype))
    reload_master_weights(setup.optimizer)


def full_grads(setup, pg: ProcessGroups) -> dict:
    """Every parameter's gradient after a step as the optimizer saw it (reduced over DP, finalized
    over TP, clipped), full shape by name. The distributed optimizer holds only its DP shard of
    each bucket reduced: the shards are gathered first."""
    ddp, opt = setup.ddp, setup.optimizer
    buffer = ddp.grad_buffer.detach().clone()
    if opt.distributed and pg.dp.size > 1:
        for bucket, r in zip(ddp.buckets, opt.ranges):
            comm.all_gather_into_tensor(buffer[bucket.start:bucket.end], r.grad.clone(), pg.dp)
    out = {}
    for name, p in setup.model.named_parameters():
        lo, hi = ddp.param_range[p]
        out[name] = gather_full(buffer[lo:hi].view(p.shape), p, pg.tp).float()
    return out


# Two runs of the same steps in different reduction orders (TP shards, DP ranks, another machine's
# SIMD kernels, other thread counts) are compared step by step from the same weights (run_steps'
# follow): after one Adam step from different weights no fixed tolerance holds (adam_step_bound).
#
# A gradient from the same weights differs by float32 rounding relative to the terms summed, so it
# is measured against the tensor's largest gradient, not elementwise: sums of ~10^3 terms through
# two layers, ~sqrt(n) * depth * 2^-24 ~ 1e-6 (measured: 7e-7 at most, ATEN_CPU_CAPABILITY default
# and avx2, one or two threads, TP=2 x DP=2).
GRAD_RTOL = 1e-5
# A mean of per-token losses from the same weights: a few roundings of each term.
LOSS_RTOL = 1e-6


def assert_grads_close(got: dict, ref: dict, rtol: float = GRAD_RTOL, where: str = "") -> None:
    """Gradients by name from the same weights, each within rtol of its tensor's largest."""
    assert got.keys() == ref.keys()
    for name, r in ref.items():
        diff = (got[name].double() - r.double()).abs().max().item()
        scale = r.abs().max().item()
        assert diff <= rtol * scale, f"{where}gradient of {name} off by {diff:.2e} (scale {scale:.2e})"


def adam_step_bound(ref_grads: list, got_grads: list, lr: float, opt) -> torch.Tensor:
    """Elementwise bound on how far one Adam step (the last of len(ref_grads)) of two runs from the
    same weights lands apart, given the gradients each run saw at every step so far.

    Adam steps by lr * u, u = m/(sqrt(v)+eps), m and v bias-corrected averages of g and g^2 with
    weights a_s and b_s that each sum to one. If every gradient differs by at most nu, m and sqrt(v)
    (a weighted RMS) each differ by at most nu, and |m| <= C sqrt(v) with C = sqrt(sum a_s^2/b_s)
    (Cauchy-Schwarz; ~1 for a few steps), so |du| <= (1 + C) nu / (sqrt(v) + eps - nu), and never
    more than 2C. Where the gradient is large this is tiny; where it is float noise (zero in exact
    arithmetic, like the key bias's, or a sum that cancels) it is up to 2C lr: a fixed tolerance
    on weights after Adam steps fails on some machine. Weight decay is the same on both sides."""
    b1, b2, eps = opt.adam_beta1, opt.adam_beta2, opt.adam_eps
    nu = torch.zeros_like(ref_grads[0], dtype=torch.float64)
    v = torch.zeros_like(nu)
    for g_ref, g_got in zip(ref_grads, got_grads):
        nu = torch.maximum(nu, (g_got.double() - g_ref.double()).abs())
        v = b2 * v + (1 - b2) * g_ref.double() ** 2
    t = len(ref_grads)
    s = (v / (1 - b2 ** t)).sqrt()
    a = [(1 - b1) * b1 ** (t - k) / (1 - b1 ** t) for k in range(1, t + 1)]
    b = [(1 - b2) * b2 ** (t - k) / (1 - b2 ** t) for k in range(1, t + 1)]
    c = math.sqrt(sum(x * x / y for x, y in zip(a, b)))
    du = (1 + c) * nu / (s + eps - nu).clamp_min(1e-300)
    return lr * torch.minimum(du, torch.full_like(du, 2 * c))


def _unclipped(grads: dict, norm: float, clip: float) -> dict:
    """The gradient before clipping (full_grads records what the optimizer stepped with)."""
    scale = (norm + 1.0e-6) / clip if clip > 0 and clip / (norm + 1.0e-6) < 1.0 else 1.0
    return {name: g.double() * scale for name, g in grads.items()}


def assert_steps_agree(got: dict, ref: dict, opt, lrs: list, weight_rtol: float | None = None) -> None:
    """Two traces of the same Adam steps (ref ran with follow=got) agree as far as float32 allows:
    loss, gradients and the gradient norm of each step from the same weights, and the weights
    after it within adam_step_bound plus weight_rtol (|w| + lr) for each side rounding its weights
    (default: two float32 ulps). opt: their OptimizerConfig; lrs: the lr of each step."""
    steps = len(lrs)
    assert all(len(x[k]) == steps for x in (got, ref) for k in ("losses", "norms", "before", "grads", "after"))
    rounding = 4 * 2.0 ** -24 if weight_rtol is None else weight_rtol
    for t in range(steps):
        where = f"step {t + 1}"
        assert all(torch.equal(got["before"][t][n], w) for n, w in ref["before"][t].items()), f"{where}: not followed"
        assert abs(got["losses"][t] - ref["losses"][t]) <= LOSS_RTOL * abs(ref["losses"][t]), \
            f"{where}: loss {got['losses'][t]} vs {ref['losses'][t]}"
        assert_grads_close(got["grads"][t], ref["grads"][t], where=f"{where}: ")
        # The norm of another gradient differs by at most the norm of the difference.
        g_ref = _unclipped(ref["grads"][t], ref["norms"][t], opt.clip_grad)
        g_got = _unclipped(got["grads"][t], got["norms"][t], opt.clip_grad)
        dist = math.sqrt(sum(((g_got[n] - g_ref[n]) ** 2).sum().item() for n in g_ref))
        assert abs(got["norms"][t] - ref["norms"][t]) <= dist + 1e-6 * ref["norms"][t], \
            f"{where}: grad norm {got['norms'][t]} vs {ref['norms'][t]}"
        for name, r in ref["after"][t].items():
            bound = adam_step_bound([g[name] for g in ref["grads"][:t + 1]], [g[name] for g in got["grads"][:t + 1]],
                                    lrs[t], opt)
            allowed = bound + rounding * (r.double().abs() + lrs[t])
            excess = (got["after"][t][name].double() - r.double()).abs() - allowed
            worst = int(excess.argmax())
            assert excess.max() <= 0, (f"{where}: {name}[{worst}] {got['after'][t][name].flatten()[worst].item():.8g}"
                                       f" vs {r.flatten()[worst].item():.8g}, allowed {allowed.flatten()[worst]:.2e}")


def distinct_traces(traces: list) -> list:
    """The traces of `traces` that differ in some bit (a loss, a norm, a tensor of the weights
    before or after a step, a gradient), in order. The ranks of a run report full quantities
    (gathered over TP, reduced over DP and CP), so most report the same trace: one reference run
    checks them all, where one run per rank repeated the same single-process steps."""
    def same(a: dict, b: dict) -> bool:
        return a["losses"] == b["losses"] and a["norms"] == b["norms"] and all(
            len(a[k]) == len(b[k]) and all(x.keys() == y.keys() and all(torch.equal(x[n], y[n]) for n in x)
                                           for x, y in zip(a[k], b[k]))
            for k in ("before", "grads", "after"))

    out = []
    for trace in traces:
        if not any(same(trace, seen) for seen in out):
            out.append(trace)
    return out


def assert_params_close(a: dict, b: dict, rtol=1e-4, atol=1e-5) -> None:
    assert a.keys() == b.keys()
    for name in a:
        torch.testing.assert_close(a[name], b[name], rtol=rtol, atol=atol, msg=lambda m, n=name: f"{n}: {m}")
