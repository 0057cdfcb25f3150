"""The optimizer against single-process math: AdamW as torch computes it, the distributed
optimizer step for step with the replicated one (at 1/DP of its memory), clipping by the global
norm over TP and DP, the learning-rate schedule."""

from __future__ import annotations

import math

import pytest
import torch
from train_helpers import LLAMA_TINY, assert_steps_agree, make_corpus, run_steps, tiny_config

from runtime.ddp import DistributedDataParallel
from runtime.grads import finalize_model_grads
from runtime.optim import Adam, LRSchedule
from runtime.parallel_state import ProcessGroups


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return make_corpus(str(tmp_path_factory.mktemp("optim")))


def _toy():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.LayerNorm(8), torch.nn.Linear(8, 3))


def test_adam_matches_torch_adamw():
    ours, theirs = _toy(), _toy()
    ddp = DistributedDataParallel(ours, ProcessGroups.single(), bucket_size=20)
    opt = Adam(ddp, ProcessGroups.single(), weight_decay=0.1, beta1=0.8, beta2=0.95, eps=1e-6)
    decay = [p for p in theirs.parameters() if p.dim() > 1]
    no_decay = [p for p in theirs.parameters() if p.dim() <= 1]
    ref = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
                            betas=(0.8, 0.95), eps=1e-6)
    g = torch.Generator().manual_seed(1)
    for step in range(5):
        x = torch.randn(4, 6, generator=g)
        lr = 0.01 * (step + 1)
        ddp.zero_grad_buffer()
        ddp(x).pow(2).mean().backward()
        finalize_model_grads(ours, ProcessGroups.single(), ddp)
        opt.step(lr)
        ref.zero_grad()
        theirs(x).pow(2).mean().backward()
        for group in ref.param_groups:
            group["lr"] = lr
        ref.step()
        # From the same weights (copied below) both see the same gradients; their update formulas
        # round differently: a few float32 ulps of |w| and of the step lr * |m/sqrt(v)| (<= ~lr).
        ulps = 8 * 2.0 ** -24
        for a, b in zip(ours.parameters(), theirs.parameters()):
            torch.testing.assert_close(a, b, rtol=ulps, atol=ulps * lr)
            with torch.no_grad():
                b.copy_(a)  # compare each step from the same weights (Adam amplifies float noise)


def _both_optimizers(rank, world, data, bf16):
    pg = ProcessGroups.initialize(tp=1)
    try:
        out = {}
        for dist_opt in (False, True):
            cfg = tiny_config(world, data, dist_opt=dist_opt, bf16=bf16, bucket=30_000, gbs=4)
            trace = {}
            # the distributed optimizer starts every step from the replicated one's weights
            follow = out[False][0] if dist_opt else None
            _, _, _, setup = run_steps(cfg, pg, 3, trace=trace, follow=follow)
            out[dist_opt] = trace, setup.optimizer.state_bytes(), setup.optimizer.replicated_state_bytes()
        return out, cfg.optimizer
    finally:
        pg.destroy()


@pytest.mark.parametrize("bf16", [False, True], ids=["fp32", "bf16"])
def test_distributed_optimizer_follows_the_replicated_one(gloo, corpus, bf16):
    for out, opt in gloo.run(2, _both_optimizers, corpus, bf16):
        (rep, rep_bytes, rep_full), (dist, dist_bytes, dist_full) = out[False], out[True]
        assert dist_full == rep_full
        # bf16: the replicated optimizer's fp32 masters round to the bf16 weights the distributed
        # one starts from, so the bf16 copies after a step may be one bf16 ulp (2^-7 |w|) apart
        assert_steps_agree(rep, dist, opt, [opt.lr] * 3, weight_rtol=2.0 ** -7 if bf16 else None)
        assert rep_bytes == rep_full
        assert dist_bytes * 2 == rep_bytes  # 1/DP of the replicated optimizer's memory, measured
        per_element = 12 if bf16 else 8  # Adam moments (+ fp32 master weights for bf16 parameters)
        assert rep_full % per_element == 0


# multi-query Llama: its one K/V head replicated on both TP ranks, each rank's copy of its
# gradient summed over TP, counted once in the norm, before the DP reduce-scatter
MQA = dict(spec=LLAMA_TINY, overrides={"num_query_groups": 1})


def _tp_clip(rank, world, data, clip):
    pg = ProcessGroups.initialize(tp=2)
    try:
        cfg = tiny_config(world, data, tp=2, sp=True, clip=clip, gbs=4, dist_opt=True, **MQA)
        trace = {}
        run_steps(cfg, pg, 2, trace=trace)
        return trace
    finally:
        pg.destroy()


def test_clipping_by_the_global_norm_over_tp_counts_each_parameter_once(gloo, corpus):
    """TP=2 x DP=2 with the distributed optimizer: sharded, replicated and replicated-head
    parameters each counted once in the norm that clips."""
    clip = 0.05  # far below the norm: every step is clipped
    cfg = tiny_config(1, corpus, clip=clip, gbs=4, **MQA)
    lrs = [cfg.optimizer.lr] * 2
    for got in gloo.run(4, _tp_clip, corpus, clip)[:1]:
        assert all(n > 10 * clip for n in got["norms"])
        ref = {}
        run_steps(cfg, ProcessGroups.single(), 2, trace=ref, follow=got)
        assert_steps_agree(got, ref, cfg.optimizer, lrs)
        unclipped = {}
        run_steps(tiny_config(1, corpus, clip=0.0, gbs=4, **MQA), ProcessGroups.single(), 2, trace=unclipped,
                  follow=got)
        with pytest.raises(AssertionError, match="step 1: gradient"):
            assert_steps_agree(got, unclipped, cfg.optimizer, lrs)  # clipping changed the update


def test_grad_norm_is_torchs_total_norm():
    model = _toy()
    ddp = DistributedDataParallel(model, ProcessGroups.single())
    opt = Adam(ddp, ProcessGroups.single(), clip_grad=0.5)
    ddp(torch.ones(3, 6)).pow(2).sum().backward()
    ddp.finish_grad_sync()
    grads = [p.main_grad.clone() for p in model.parameters()]
    expected = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads])).item()
    # float32 sums of squares of up to 48 elements, in two orders: n 2^-24 ~ 3e-6 at worst
    assert opt.grad_norm() == pytest.approx(expected, rel=1e-5)
    opt.step(0.0)  # lr 0: only the clipping shows, in the gradients
    scale = 0.5 / (expected + 1e-6)
    for p, g in zip(model.parameters(), grads):
        torch.testing.assert_close(p.main_grad, g * scale)


def test_non_finite_gradients_skip_the_step():
    model = _toy()
    ddp = DistributedDataParallel(model, ProcessGroups.single())
    opt = Adam(ddp, ProcessGroups.single())
    before = [p.detach().clone() for p in model.parameters()]
    ddp(torch.full((2, 6), float("inf"))).sum().backward()
    ddp.finish_grad_sync()
    norm, applied = opt.step(0.1)
    assert not applied and not math.isfinite(norm) and opt.step_count == 0
    assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before))


def test_lr_schedule():
    cos = LRSchedule(1.0, 0.1, warmup_iters=10, decay_iters=110, style="cosine")
    assert [cos(i) for i in (1, 5, 10)] == pytest.approx([0.1, 0.5, 1.0])
    assert cos(60) == pytest.approx(0.55)  # halfway through the decay
    assert cos(110) == cos(500) == pytest.approx(0.1)
    lin = LRSchedule(1.0, 0.0, warmup_iters=0, decay_iters=100, style="linear")
    assert [lin(i) for i in (1, 25, 100)] == pytest.approx([0.99, 0.75, 0.0])
    assert LRSchedule(2.0, 0.0, 5, 10, "constant")(8) == 2.0
    values = [cos(i) for i in range(11, 111)]
    assert all(a >= b for a, b in zip(values, values[1:]))  # monotone decay
    with pytest.raises(ValueError):
        LRSchedule(1.0, 0.0, warmup_iters=20, decay_iters=10)
