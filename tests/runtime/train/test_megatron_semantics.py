"""Megatron's training semantics (issue 26), each against a reference computation: the loss mask
of --eod-mask-loss (get_ltor_masks_and_position_ids), --calculate-per-token-loss at DP 2 with
uneven masks (Megatron's forward_step and finalize_model_grads), --decoupled-lr (the word
embedding's and output layer's own lr and schedule), and --rampup-batch-size
(RampupBatchsizeNumMicroBatchesCalculator, update_train_iters), the last end to end: a run that
uses all of them resumes from a checkpoint saved mid-ramp and continues exactly."""

from __future__ import annotations

import io
import json
import math
import os

import pytest
import torch
from train_helpers import LLAMA_TINY

from runtime.checkpoint import complete_steps, step_dirname
from runtime.init import init_name
from runtime.parallel_state import ProcessGroups
from runtime.train.config import OptimizerConfig, ParallelConfig, TrainConfig, resolve
from runtime.train.training import (
    embedding_and_output_weights,
    lm_forward_step,
    micro_batch,
    setup_model_and_optimizer,
    train_step,
)
from specc_torch.train import run
from specc_torch.train_compile import compile_model

VOCAB, SEQ = 256, 32


def _cfg(world: int, pp: int = 1, **opt) -> TrainConfig:
    # llama-tiny: no dropout, so every forward of the same weights gives the same loss
    cfg = TrainConfig(spec=LLAMA_TINY, micro_batch_size=2, global_batch_size=8 if pp > 1 else 4 * world,
                      parallel=ParallelConfig(pp=pp), optimizer=OptimizerConfig(clip_grad=0.0, weight_decay=0.0, **opt))
    assert resolve(cfg, world) == [] and cfg.num_micro_batches == 2 * pp
    return cfg


def _batches(rank: int) -> list:
    """Rank `rank`'s two micro-batches (tokens, labels, loss mask): each micro-batch and rank masks
    a different share of its tokens."""
    g = torch.Generator().manual_seed(100 + rank)
    out = []
    for m in range(2):
        tokens, labels = (torch.randint(0, VOCAB, (2, SEQ), generator=g) for _ in range(2))
        out.append((tokens, labels, (torch.rand(2, SEQ, generator=g) < 0.2 + 0.3 * m + 0.4 * rank).float()))
    return out


def _steps(rank, world, pp):
    """One step per loss mode at lr 0 (the weights stay): the reported loss, every gradient (by
    its PP = 1 name). DP 2: each rank its own micro-batches; PP 2: all four through the pipeline."""
    pg = ProcessGroups.initialize(tp=1, pp=pp)
    try:
        cfg = _cfg(world, pp)
        compiled = compile_model(cfg)
        out = {}
        for per_token in (True, False):
            setup = setup_model_and_optimizer(cfg, pg, compiled=compiled)
            batches = _batches(0) + _batches(1) if pp > 1 else _batches(rank)
            result = train_step(setup, batches, 0.0, pg, per_token_loss=per_token)
            out[per_token] = (result.loss, {init_name(n, p): p.main_grad.clone()
                                            for n, p in setup.model.named_parameters()})
        return out
    finally:
        pg.destroy()


@pytest.mark.parametrize("pp", [1, 2], ids=["dp2", "pp2"])
def test_per_token_loss_with_uneven_masks_is_megatrons(gloo, pp):
    got = gloo.run(2, _steps, pp)
    cfg = _cfg(1)
    setup = setup_model_and_optimizer(cfg, ProcessGroups.single(), compiled=compile_model(cfg))
    model = setup.model
    batches = [_batches(0), _batches(1)]  # [rank][micro-batch]
    losses = [[lm_forward_step(model, b) * b[2] for b in rank] for rank in batches]
    tokens = sum(float(b[2].sum()) for rank in batches for b in rank)
    reported = sum(float(x.detach().sum()) for rank in losses for x in rank) / tokens  # Megatron's 'lm loss'

    want = {  # per token: one sum over the global batch / its loss tokens; else the mean of micro-batch means
        True: sum(x.sum() for rank in losses for x in rank) / tokens,
        False: sum(x.sum() / b[2].sum() for rank, bs in zip(losses, batches) for x, b in zip(rank, bs)) / 4,
    }
    for per_token, loss in want.items():
        setup.ddp.zero_grad_buffer()  # autograd's gradients land in main_grad (the DDP's hooks)
        loss.backward(retain_graph=True)
        for rank in got:
            got_loss, grads = rank[per_token]
            assert got_loss == pytest.approx(reported, rel=1e-6)
            assert grads  # every stage's parameters, at PP 2 each rank its own
            for name, p in model.named_parameters():  # fp32 sums in another order: a few ulps of the largest
                if name in grads:
                    want = p.main_grad
                    torch.testing.assert_close(grads[name], want, rtol=1e-5, atol=1e-6 * float(want.abs().max()))
    # the two modes differ where the masks are uneven
    assert not torch.allclose(got[0][True][1]["embedding.weight"], got[0][False][1]["embedding.weight"], rtol=1e-3)
    assert len(set(got[0][True][1]) | set(got[1][True][1])) == len(dict(model.named_parameters()))


def test_eod_mask_loss_is_megatrons_loss_mask():
    class Data:  # one micro-batch of 2 samples with end-of-document tokens (id 7) in them
        def micro_batch(self, consumed, micro, mbs, dp_rank, dp_size):
            rows = torch.tensor([[1, 7, 2, 3, 7, 7, 4], [7, 5, 6, 7, 8, 9, 1]]).numpy()
            return rows[:, :-1], rows[:, 1:]

    cfg = _cfg(1)
    cfg.data.eod_mask_loss, cfg.data.eod = True, 7
    tokens, _, mask = micro_batch(Data(), 0, 0, cfg, ProcessGroups.single(), torch.device("cpu"))
    for row, got in zip(tokens, mask):  # Megatron's: loss_mask[data == eod_token] = 0.0, on the input tokens
        want = torch.ones(row.numel())
        want[row == 7] = 0.0
        assert torch.equal(got, want)


def test_decoupled_lr_steps_the_embedding_and_output_layer_with_their_own_schedule():
    cfg = _cfg(1, optimizer="sgd", sgd_momentum=0.0, lr=0.1, min_lr=0.01, decoupled_lr=0.5, decoupled_min_lr=0.05)
    cfg.schedule.lr_warmup_iters, cfg.schedule.lr_decay_style = 2, "cosine"
    setup = setup_model_and_optimizer(cfg, ProcessGroups.single(), compiled=compile_model(cfg))
    names = {id(p): n for n, p in setup.model.named_parameters()}
    assert {names[id(p)] for p in embedding_and_output_weights(setup.model, VOCAB)} == {
        "embedding.weight", "output_layer.weight"}  # Megatron's is_embedding_or_output_parameter
    # Megatron's OptimizerParamScheduler per group: warmup from 0, cosine to the group's min
    for it, (lr, dlr) in {1: (0.05, 0.25), 2: (0.1, 0.5), 100: (0.01, 0.05)}.items():
        assert (setup.schedule(it), setup.decoupled_schedule(it)) == pytest.approx((lr, dlr))
    mid = 0.5 * (math.cos(math.pi * 49 / 98) + 1)
    assert setup.decoupled_schedule(51) == pytest.approx(0.05 + 0.45 * mid)
    before = {n: p.detach().clone() for n, p in setup.model.named_parameters()}
    train_step(setup, _batches(0), 0.1, ProcessGroups.single(), decoupled_lr=0.5)
    for n, p in setup.model.named_parameters():  # plain SGD: w - lr * g, each with its own lr
        lr = 0.5 if n in ("embedding.weight", "output_layer.weight") else 0.1
        torch.testing.assert_close(p.detach(), before[n] - lr * p.main_grad, rtol=0, atol=1e-7)


def _megatron_ramp(start, increment, samples, global_batch, train_samples) -> list:
    """Megatron's RampupBatchsizeNumMicroBatchesCalculator.update and update_train_iters, as written
    there: the global batch of every iteration of a --train-samples run."""
    per_increment = samples / ((global_batch - start) // increment)

    def batch(consumed):
        return global_batch if consumed > samples else start + int(consumed / per_increment) * increment

    out, consumed = [], 0
    while consumed <= samples and consumed <= train_samples:
        out.append(batch(consumed))
        consumed += out[-1]
    return out + [global_batch] * ((train_samples - consumed) // global_batch if train_samples > consumed else 0)


def test_rampup_batch_size_follows_megatrons_calculator():
    for ramp, gbs, samples in (((2, 2, 8), 6, 20), ((16, 8, 300), 64, 1000), ((4, 4, 30), 16, 25)):
        cfg = TrainConfig(spec="x.yaml", micro_batch_size=2, global_batch_size=gbs, train_samples=samples,
                          train_iters=None, rampup_batch_size=ramp)
        assert resolve(cfg, 1) == []
        want = _megatron_ramp(*ramp, gbs, samples)
        consumed, got = 0, []
        for _ in range(cfg.train_iters):
            got.append(cfg.batch_size_at(consumed))
            consumed += got[-1]
        assert got == want
    bad = TrainConfig(spec="x.yaml", micro_batch_size=4, global_batch_size=16, rampup_batch_size=(2, 2, 8))
    assert resolve(bad, 1) == ["--rampup-batch-size needs --train-samples N (the ramp counts samples; "
                               "iteration-based training has none, as in Megatron)"]
    bad = TrainConfig(spec="x.yaml", micro_batch_size=4, global_batch_size=16, train_samples=64, train_iters=None,
                      rampup_batch_size=(2, 2, 8))
    assert "every batch of the ramp must divide by micro batch * DP" in resolve(bad, 1)[0]


def _run(run_dir, load=None):
    cfg = TrainConfig(spec=LLAMA_TINY, micro_batch_size=1, global_batch_size=6, train_samples=20, train_iters=None,
                      rampup_batch_size=(2, 2, 8), calculate_per_token_loss=True, eval_iters=0,
                      optimizer=OptimizerConfig(lr=1e-2, decoupled_lr=3e-2))
    cfg.data.mock_data, cfg.data.tokenizer_type, cfg.data.vocab_size = True, "NullTokenizer", 255  # EOD: id 255
    cfg.data.eod_mask_loss = True
    cfg.logging.run_dir, cfg.logging.progress = str(run_dir), False
    cfg.checkpoint.save, cfg.checkpoint.load = str(run_dir / "ckpt"), load
    out = io.StringIO()
    assert run(cfg, stream=out) == 0, out.getvalue()
    return [json.loads(line) for line in open(run_dir / "metrics.jsonl")], out.getvalue()


def test_a_run_ramping_up_resumes_mid_ramp_exactly(tmp_path):
    records, log = _run(tmp_path / "a")
    assert [r["batch_size"] for r in records] == [2, 2, 4, 6, 6] == _megatron_ramp(2, 2, 8, 6, 20)
    assert [r["consumed_samples"] for r in records] == [2, 4, 8, 14, 20]
    assert "ramping up the global batch to 4 after 4 samples" in log
    # as Megatron, a checkpoint before each new batch size (and the last)
    assert complete_steps(str(tmp_path / "a" / "ckpt")) == [2, 3, 5]
    resumed, _ = _run(tmp_path / "b", load=os.path.join(tmp_path / "a" / "ckpt", step_dirname(2)))
    assert [r["batch_size"] for r in resumed] == [4, 6, 6]
    assert [r["loss"] for r in resumed] == pytest.approx([r["loss"] for r in records[2:]], rel=1e-6)
    assert [r["lr"] for r in resumed] == [r["lr"] for r in records[2:]]
