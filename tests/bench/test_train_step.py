"""bench/train_step.py's shared pieces that every bench's numbers rest on: the plan's FLOPs, split
by op kind, and the timed step's optimizer."""

from __future__ import annotations

import types

import torch
from bench_modules import load

train_step = load("train_step")
CFG = types.SimpleNamespace(vocab=512, hidden=64, layers=2, heads=4, seq=32, batch=2)


def test_the_flops_by_kind_add_up_to_the_step_and_follow_the_shapes():
    kinds = train_step.plan_flops_by_kind(CFG)
    assert sum(kinds.values()) == train_step.plan_flops(CFG)
    t, h, s = CFG.batch * CFG.seq, CFG.hidden, CFG.seq
    # forward + backward = 3x forward; the linears: QKV, proj, fc1, fc2 per layer, the output layer
    assert kinds["linear"] == 3 * (CFG.layers * 2 * t * 12 * h * h + 2 * t * h * CFG.vocab)
    # causal attention counts half of QK^T and AV
    assert kinds["core_attention"] == 3 * CFG.layers * 2 * CFG.batch * s * s * h


def test_the_runner_steps_with_the_optimizer_it_is_given():
    def step(fused):
        torch.manual_seed(0)
        model = torch.nn.Linear(8, 4)
        runner = train_step.Runner("m", model, lambda m, b: m(b).square().mean(), fused_adamw=fused)
        assert runner.opt.defaults["fused" if fused else "foreach"]
        runner.step(torch.randn(3, 8))
        return model.weight.detach().clone()

    # the same AdamW update whichever kernel runs it (lr 1e-4: float rounding is far below it)
    torch.testing.assert_close(step(True), step(False), rtol=0, atol=1e-7)
