import pytest
import torch
from torch import nn

from runtime.comm import CommCounter
from runtime.grads import finalize_model_grads, is_tp_partial_grad, mark_tp_partial_grad
from runtime.layers import RMSNorm
from runtime.parallel_state import ProcessGroups

S, B, H = 8, 2, 6


class SequenceParallelNorms(nn.Module):
    """Norm weight and a bias used on S(s) values: their gradients are partial."""

    def __init__(self):
        super().__init__()
        self.norm = RMSNorm(H)
        self.bias = nn.Parameter(torch.zeros(H))
        self.untagged = nn.Parameter(torch.zeros(H))
        self.unused = nn.Parameter(torch.zeros(3))
        for p in (self.norm.weight, self.bias, self.unused):
            mark_tp_partial_grad(p)

    def forward(self, x):
        return self.norm(x) + self.bias + self.untagged


def _model_and_grads(x, grad):
    model = SequenceParallelNorms()
    with torch.no_grad():
        model.norm.weight.copy_(torch.linspace(0.5, 1.5, H))
    model(x).backward(grad)
    return model


def _check_sequence_parallel_grads(rank, world):
    pg = ProcessGroups.initialize(tp=world)
    try:
        g = torch.Generator().manual_seed(0)
        x_full, grad_full = torch.randn(S, B, H, generator=g), torch.randn(S, B, H, generator=g)
        ref = _model_and_grads(x_full, grad_full)

        # Sequence parallel: each rank sees its rows only.
        model = _model_and_grads(x_full.chunk(world)[rank], grad_full.chunk(world)[rank])
        assert not torch.allclose(model.norm.weight.grad, ref.norm.weight.grad)  # partial before
        untagged_before = model.untagged.grad.clone()
        with CommCounter() as c:
            finalize_model_grads(model, pg)
        # One all-reduce over the coalesced tagged gradients (H + H + 3 floats).
        assert c.totals() == {"all_reduce": (1, (2 * H + 3) * 4)}, c.totals()
        torch.testing.assert_close(model.norm.weight.grad, ref.norm.weight.grad)
        torch.testing.assert_close(model.bias.grad, ref.bias.grad)
        assert torch.equal(model.untagged.grad, untagged_before)  # not tagged: untouched
        assert torch.equal(model.unused.grad, torch.zeros(3))  # no grad anywhere: zeros
        gathered = [torch.empty_like(model.norm.weight.grad) for _ in range(world)]
        torch.distributed.all_gather(gathered, model.norm.weight.grad)
        assert all(torch.equal(t, gathered[0]) for t in gathered)  # bit-identical across ranks
    finally:
        pg.destroy()


@pytest.mark.parametrize("world", [2, 4])
def test_finalize_sums_partial_grads(gloo, world):
    gloo.run(world, _check_sequence_parallel_grads)


def test_single_process_finalize_is_a_no_op():
    x = torch.randn(S, B, H)
    model = _model_and_grads(x, torch.ones(S, B, H))
    before = model.norm.weight.grad.clone()
    with CommCounter() as c:
        finalize_model_grads(model, ProcessGroups.single())
    assert c.totals() == {} and torch.equal(model.norm.weight.grad, before)
    assert is_tp_partial_grad(model.bias) and not is_tp_partial_grad(model.untagged)


def test_mark_returns_the_parameter():
    p = nn.Parameter(torch.zeros(2))
    assert mark_tp_partial_grad(p) is p
