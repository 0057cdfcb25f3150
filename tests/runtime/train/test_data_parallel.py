"""Data parallelism against single-process math: DP=2 follows DP=1 with twice the micro-batches,
gradients are reduced in buckets during backward, and gradient accumulation and tied weights
give the gradients one big batch gives."""

from __future__ import annotations

import pytest
import torch
from train_helpers import (
    assert_grads_close,
    assert_params_close,
    assert_steps_agree,
    distinct_traces,
    make_corpus,
    run_steps,
    tiny_config,
)

from runtime.comm import CommCounter
from runtime.ddp import DistributedDataParallel
from runtime.grads import finalize_model_grads
from runtime.parallel_state import ProcessGroups
from runtime.train.training import micro_batch, setup_model_and_optimizer
from specc_torch.train_compile import compile_model

STEPS = 3


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return make_corpus(str(tmp_path_factory.mktemp("dp")))


def _dp_run(rank, world, data, dist_opt, bucket):
    pg = ProcessGroups.initialize(tp=1)
    try:
        cfg = tiny_config(world, data, dist_opt=dist_opt, bucket=bucket)
        assert cfg.num_micro_batches == 2
        trace = {}
        run_steps(cfg, pg, STEPS, trace=trace)
        return trace
    finally:
        pg.destroy()


@pytest.mark.parametrize("dist_opt", [False, True], ids=["replicated", "distributed-optimizer"])
def test_dp2_follows_dp1_with_twice_the_micro_batches(gloo, corpus, dist_opt):
    ref_cfg = tiny_config(1, corpus)
    assert ref_cfg.num_micro_batches == 4  # the same global batch of 8 on one rank
    # Small buckets: several reductions per step, started during backward.
    results = gloo.run(2, _dp_run, corpus, dist_opt, 20_000)
    for got in distinct_traces(results):  # one reference run for identical ranks
        ref = {}
        run_steps(ref_cfg, ProcessGroups.single(), STEPS, trace=ref, follow=got)
        assert ref["losses"][-1] < ref["losses"][0]
        assert_steps_agree(got, ref, ref_cfg.optimizer, [ref_cfg.optimizer.lr] * STEPS)
    assert_params_close(results[0]["after"][-1], results[1]["after"][-1], rtol=0, atol=0)  # the replicas stay identical


def _buckets_start_during_backward(rank, world, data):
    pg = ProcessGroups.initialize(tp=1)
    try:
        cfg = tiny_config(world, data, mbs=2, gbs=4, bucket=10_000)
        setup = setup_model_and_optimizer(cfg, pg, compiled=compile_model(cfg))
        ddp = setup.ddp
        from runtime.data import build_datasets
        ds = build_datasets(data, 32, cfg.seed, (0.9, 0.1, 0.0))["train"]
        tokens, labels = micro_batch(ds, 0, 0, cfg, pg, setup.device)
        ddp.zero_grad_buffer()
        launched_during = []

        def watch(_):
            launched_during.append(sum(b.launched for b in ddp.buckets))

        # A hook on the input embedding (the last gradient backward produces) sees how many
        # buckets had already started by then.
        setup.model.embedding.weight.register_post_accumulate_grad_hook(watch)
        with CommCounter() as counter:
            ddp(tokens, labels).mean().backward()
            started = sum(b.launched for b in ddp.buckets)
            finalize_model_grads(setup.model, pg, ddp)
        count, nbytes = counter.totals()["all_reduce"]
        return len(ddp.buckets), started, count, nbytes, ddp.numel, launched_during
    finally:
        pg.destroy()


def test_buckets_reduce_during_backward_in_order(gloo, corpus):
    for n_buckets, started, count, nbytes, numel, during in gloo.run(2, _buckets_start_during_backward, corpus):
        assert n_buckets >= 5
        assert started == n_buckets  # every bucket started before backward returned
        assert during and during[0] >= n_buckets - 2  # most had started before the last gradient came
        assert count == n_buckets and nbytes == numel * 4  # one all-reduce per bucket, fp32 over the buffer


def test_accumulation_equals_one_big_batch(corpus):
    """4 micro-batches of 2 accumulate exactly the gradient of one micro-batch of 8."""
    pg = ProcessGroups.single()
    grads = []
    for mbs in (2, 8):
        cfg = tiny_config(1, corpus, mbs=mbs, gbs=8)
        setup = setup_model_and_optimizer(cfg, pg, compiled=compile_model(cfg))
        from runtime.data import build_datasets
        ds = build_datasets(corpus, 32, cfg.seed, (0.9, 0.1, 0.0))["train"]
        batches = [micro_batch(ds, 0, m, cfg, pg, setup.device) for m in range(cfg.num_micro_batches)]
        setup.ddp.zero_grad_buffer()
        for i, batch in enumerate(batches):
            ctx = setup.ddp.no_sync() if i < len(batches) - 1 else torch.enable_grad()
            with ctx:
                (setup.ddp(*batch).mean() / len(batches)).backward()
        finalize_model_grads(setup.model, pg, setup.ddp)
        grads.append({n: p.main_grad.clone() for n, p in setup.model.named_parameters()})
    assert_grads_close(grads[0], grads[1])  # summed in another order


def test_tied_weight_is_one_parameter_with_both_gradients(corpus):
    pg = ProcessGroups.single()
    cfg = tiny_config(1, corpus)
    setup = setup_model_and_optimizer(cfg, pg, compiled=compile_model(cfg))
    model = setup.model
    assert model.output_layer.weight is model.embedding.weight
    names = [n for n, _ in model.named_parameters()]
    assert "embedding.weight" in names and "output_layer.weight" not in names  # listed once
    tokens = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(0))
    labels = torch.roll(tokens, -1, 1)
    setup.ddp.zero_grad_buffer()
    setup.ddp(tokens, labels).mean().backward()
    finalize_model_grads(model, pg, setup.ddp)
    # Reference: an untied copy whose two weights' gradients add up to the tied gradient.
    import specc_torch

    plain = specc_torch.build_model(cfg.spec, pg, seed=cfg.seed)
    plain.output_layer.weight = torch.nn.Parameter(plain.embedding.weight.detach().clone())
    plain(tokens, labels).mean().backward()
    both = plain.embedding.weight.grad + plain.output_layer.weight.grad
    assert plain.embedding.weight.grad.abs().sum() > 0 and plain.output_layer.weight.grad.abs().sum() > 0
    torch.testing.assert_close(model.embedding.weight.main_grad, both, rtol=1e-5, atol=1e-7)


def test_a_second_synchronized_backward_before_finish_is_an_error():
    model = torch.nn.Linear(4, 4)
    for p in model.parameters():
        p._specc_init = None
    ddp = DistributedDataParallel(model, ProcessGroups.single())
    ddp(torch.ones(2, 4)).sum().backward()
    with pytest.raises(RuntimeError, match="no_sync"):
        ddp(torch.ones(2, 4)).sum().backward()
    ddp.zero_grad_buffer()
    with ddp.no_sync():
        ddp(torch.ones(2, 4)).sum().backward()
    ddp(torch.ones(2, 4)).sum().backward()
    ddp.finish_grad_sync()
    torch.testing.assert_close(model.bias.main_grad, torch.full((4,), 4.0))  # 2 rows x 2 backwards


def test_parameters_live_in_the_flat_buffers():
    model = torch.nn.Sequential(torch.nn.Linear(3, 5), torch.nn.Linear(5, 2))
    before = [p.detach().clone() for p in model.parameters()]
    ddp = DistributedDataParallel(model, ProcessGroups.single(), bucket_size=10)
    for p, old in zip(model.parameters(), before):
        assert torch.equal(p, old)
        assert p.untyped_storage().data_ptr() == ddp.param_buffer.untyped_storage().data_ptr()
        assert p.main_grad.dtype == torch.float32
    assert len(ddp.buckets) >= 2
    assert sum(len(b.params) for b in ddp.buckets) == 4
