import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from runtime.comm import CommCounter
from runtime.cross_entropy import vocab_parallel_cross_entropy
from runtime.parallel_state import Group

close = torch.testing.assert_close


def reference(logits_full, labels):
    """F.cross_entropy per token: logits [s, b, V], labels [b, s] -> [b, s]."""
    s, b, vocab = logits_full.shape
    flat = logits_full.transpose(0, 1).reshape(b * s, vocab)
    return F.cross_entropy(flat, labels.reshape(-1), reduction="none").view(b, s)


def make_inputs(s, b, vocab, seed, scale=3.0):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(s, b, vocab, generator=g) * scale
    labels = torch.randint(0, vocab, (b, s), generator=g)
    return logits, labels


def check_against_reference(logits_full, labels, tp, dtype=torch.float32):
    vocab = logits_full.shape[-1]
    ref_in = logits_full.clone().requires_grad_(True)
    loss_ref = reference(ref_in, labels)
    grad_loss = torch.rand(loss_ref.shape, generator=torch.Generator().manual_seed(1))
    loss_ref.backward(grad_loss)

    local = logits_full.chunk(tp.size, dim=-1)[tp.rank].to(dtype).requires_grad_(True)
    loss = vocab_parallel_cross_entropy(local, labels, tp)
    assert loss.dtype == torch.float32 and loss.shape == labels.shape
    loss.backward(grad_loss)
    assert local.grad.dtype == dtype
    tol = {} if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)
    if dtype == torch.float32:
        close(loss, loss_ref)
    close(local.grad.float(), ref_in.grad.chunk(tp.size, dim=-1)[tp.rank], **tol)
    return vocab


def test_single_rank_equals_torch_without_distributed():
    assert not dist.is_initialized()
    logits, labels = make_inputs(6, 3, 11, seed=0)
    check_against_reference(logits, labels, Group.single("tp"))


@settings(max_examples=25, deadline=None)
@given(s=st.integers(1, 5), b=st.integers(1, 3), vocab=st.integers(1, 9), seed=st.integers(0, 2**16),
       scale=st.sampled_from([0.1, 3.0, 80.0]))
def test_single_rank_property(s, b, vocab, seed, scale):
    # Large logits check the max-subtraction (exp would overflow without it).
    logits, labels = make_inputs(s, b, vocab, seed, scale)
    check_against_reference(logits, labels, Group.single("tp"))


def test_low_precision_logits_give_fp32_loss():
    logits, labels = make_inputs(4, 2, 8, seed=3)
    loss = vocab_parallel_cross_entropy(logits.bfloat16(), labels, Group.single("tp"))
    close(loss, reference(logits.bfloat16().float(), labels))
    check_against_reference(logits, labels, Group.single("tp"), dtype=torch.bfloat16)


def test_shape_checks():
    with pytest.raises(ValueError, match=r"expected logits \[s, b, V/t\] and labels \[b, s\]"):
        vocab_parallel_cross_entropy(torch.zeros(4, 2, 8), torch.zeros(4, 2, dtype=torch.long), Group.single("tp"))


def _check_vocab_parallel(rank, world):
    tp = Group(size=world, rank=rank, group=dist.group.WORLD, ranks=tuple(range(world)), name="tp")
    s, b, vocab = 6, 3, 16
    logits, labels = make_inputs(s, b, vocab, seed=5)
    # Labels on every shard edge.
    edges = [r * vocab // world for r in range(world)] + [(r + 1) * vocab // world - 1 for r in range(world)]
    labels.view(-1)[: len(edges)] = torch.tensor(edges)
    with CommCounter() as fwd_bwd:
        check_against_reference(logits, labels, tp)
    # Two all-reduces forward (MAX [s, b]; SUM of [predicted, sum-exp] [2, s, b]), none backward.
    assert fwd_bwd.totals() == {"all_reduce": (2, s * b * 4 + 2 * s * b * 4)}, fwd_bwd.totals()
    check_against_reference(logits * 40.0, labels, tp)  # far from zero: stability across shards
    check_against_reference(logits, labels, tp, dtype=torch.bfloat16)


@pytest.mark.parametrize("world", [2, 4])
def test_vocab_parallel_equals_torch_on_gathered_logits(gloo, world):
    gloo.run(world, _check_vocab_parallel)
