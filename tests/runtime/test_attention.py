import importlib.util
import math

import pytest
import torch
from torch import nn

from runtime import mappings
from runtime.activations import split
from runtime.attention import CoreAttention
from runtime.grads import finalize_model_grads, mark_tp_partial_grad
from runtime.init import gather_full, init_parameters
from runtime.layers import ColumnParallelLinear, LayerNorm, RotaryEmbedding, RowParallelLinear
from runtime.parallel_state import Group, ProcessGroups
from runtime.random import RNGTracker

close = torch.testing.assert_close


def seeded(seed, *shape):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def reference_attention(q, k, v, nh, ng, d, causal):
    """Loop over batch and heads; query head i reads kv head i // (nh / ng)."""
    s, b = q.shape[:2]
    out = torch.empty(s, b, nh * d, dtype=q.dtype)
    for bi in range(b):
        for i in range(nh):
            j = i // (nh // ng)
            qi, kj, vj = q[:, bi, i * d:(i + 1) * d], k[:, bi, j * d:(j + 1) * d], v[:, bi, j * d:(j + 1) * d]
            scores = qi @ kj.t() / math.sqrt(d)
            if causal:
                scores = scores.masked_fill(torch.ones(s, s, dtype=torch.bool).triu(1), float("-inf"))
            out[:, bi, i * d:(i + 1) * d] = torch.softmax(scores, dim=-1) @ vj
    return out


def qkv(s, b, nh, ng, d):
    return [seeded(i, s, b, n * d).requires_grad_(True) for i, n in enumerate((nh, ng, ng))]


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("nh, ng", [(4, 4), (4, 2), (4, 1)])
def test_sdpa_unfused_and_reference_agree(causal, nh, ng):
    d, s, b = 4, 5, 2
    results = []
    for backend in ("sdpa", "unfused"):
        q, k, v = qkv(s, b, nh, ng, d)
        out = CoreAttention(nh, ng, d, causal=causal, backend=backend)(q, k, v)
        out.backward(seeded(9, *out.shape))
        results.append((out, q.grad, k.grad, v.grad))
    q, k, v = qkv(s, b, nh, ng, d)
    expected = reference_attention(q.detach(), k.detach(), v.detach(), nh, ng, d, causal)
    close(results[0][0], expected)
    for a, b_ in zip(*results):
        close(a, b_)


def test_grouped_query_equals_explicit_repeat():
    nh, ng, d, s, b = 6, 2, 4, 5, 3
    q, k, v = (t.detach() for t in qkv(s, b, nh, ng, d))

    def repeat(x):  # [s, b, ng*d] -> [s, b, nh*d], each kv head serving nh/ng query heads
        return x.view(s, b, ng, d).repeat_interleave(nh // ng, dim=2).reshape(s, b, nh * d)

    for backend in ("sdpa", "unfused"):
        gqa = CoreAttention(nh, ng, d, backend=backend)(q, k, v)
        mha = CoreAttention(nh, nh, d, backend=backend)(q, repeat(k), repeat(v))
        close(gqa, mha)


def test_attention_dropout_uses_the_tensor_parallel_stream():
    nh, d, s, b = 2, 4, 6, 2
    q, k, v = (t.detach().float() for t in qkv(s, b, nh, nh, d))
    for backend in ("sdpa", "unfused"):
        def run(tp_rank):
            attn = CoreAttention(nh, nh, d, dropout=0.5, backend=backend, rng_tracker=RNGTracker(5, tp_rank))
            return attn(q, k, v)

        state = torch.get_rng_state()
        rank0, rank0_again, rank1 = run(0), run(0), run(1)
        assert torch.equal(torch.get_rng_state(), state), backend
        assert torch.equal(rank0, rank0_again), backend  # reproducible from the seed
        assert not torch.equal(rank0, rank1), backend  # each rank's heads get their own mask
        attn = CoreAttention(nh, nh, d, dropout=0.5, backend=backend, rng_tracker=RNGTracker(5, 0)).eval()
        close(attn(q, k, v), CoreAttention(nh, nh, d, backend=backend)(q, k, v))


def test_attention_argument_checks():
    with pytest.raises(ValueError, match="multiple of num_kv_heads"):
        CoreAttention(4, 3, 8)
    with pytest.raises(ValueError, match="backend must be one of"):
        CoreAttention(4, 4, 8, backend="xformers")
    attn = CoreAttention(4, 2, 8)
    with pytest.raises(ValueError, match=r"k must be \[s, b, 2\*8=16\]"):
        attn(torch.zeros(3, 1, 32), torch.zeros(3, 1, 32), torch.zeros(3, 1, 16))


@pytest.mark.skipif(importlib.util.find_spec("flash_attn") is not None, reason="flash-attn is installed")
def test_flash_backend_reports_missing_package():
    with pytest.raises(ImportError, match="flash-attn package"):
        CoreAttention(4, 4, 8, backend="flash")


@pytest.mark.skipif(importlib.util.find_spec("transformer_engine") is not None, reason="TE is installed")
def test_te_backend_reports_missing_package():
    with pytest.raises(ImportError, match="TransformerEngine"):
        CoreAttention(4, 4, 8, backend="te")


# ---------------------------------------------------------------------------
# A whole pre-norm attention block: TP and TP+SP reproduce TP=1.


class AttentionBlock(nn.Module):
    """x -> LayerNorm -> fused QKV (GQA segments) -> rotary -> attention -> proj, + residual."""

    def __init__(self, tp: Group, sequence_parallel: bool, h=16, nh=8, ng=4, d=4):
        super().__init__()
        t = tp.size
        self.tp, self.sp = tp, sequence_parallel and t > 1
        self.norm = LayerNorm(h)
        self.qkv = ColumnParallelLinear(
            h, (nh + 2 * ng) * d, tp=tp, segments=[nh * d, ng * d, ng * d],
            input_mode="gather" if self.sp else "copy",
        )
        self.local_sizes = [nh * d // t, ng * d // t, ng * d // t]
        self.rotary = RotaryEmbedding(d)
        self.attention = CoreAttention(nh // t, ng // t, d, backend="sdpa")
        self.proj = RowParallelLinear(nh * d, h, tp=tp)
        if self.sp:  # used on S(s) values: each rank holds part of their gradients
            mark_tp_partial_grad(self.norm.weight)
            mark_tp_partial_grad(self.norm.bias)
            mark_tp_partial_grad(self.proj.bias)

    def forward(self, x):
        q, k, v = split(self.qkv(self.norm(x)), self.local_sizes)
        out = self.proj(self.attention(self.rotary(q), self.rotary(k), v))
        if self.sp:
            out = mappings.reduce_scatter_to_sequence_parallel_region(out, self.tp)
        else:
            out = mappings.reduce_from_tensor_model_parallel_region(out, self.tp)
        return x + out + self.proj.bias


def _check_attention_block(rank, world, sequence_parallel):
    pg = ProcessGroups.initialize(tp=world)
    try:
        block, ref = AttentionBlock(pg.tp, sequence_parallel), AttentionBlock(Group.single("tp"), False)
        init_parameters(block, seed=11)
        init_parameters(ref, seed=11)
        with torch.no_grad():  # non-trivial norm and bias values
            for m in (block, ref):
                m.norm.weight.add_(seeded(1, 16).float() * 0.1)
                m.proj.bias.copy_(seeded(2, 16).float())
        x_ref = seeded(3, 8, 2, 16).float().requires_grad_(True)
        grad = seeded(4, 8, 2, 16).float()
        y_ref = ref(x_ref)
        y_ref.backward(grad)

        rows = (lambda t: t.chunk(world, dim=0)[rank]) if sequence_parallel else (lambda t: t)
        x = rows(x_ref).detach().clone().requires_grad_(True)
        y = block(x)
        close(y, rows(y_ref))
        y.backward(rows(grad))
        finalize_model_grads(block, pg)
        close(x.grad, rows(x_ref.grad))
        for (name, p), (_, p_ref) in zip(block.named_parameters(), ref.named_parameters()):
            close(gather_full(p.grad, p, pg.tp), p_ref.grad, msg=lambda m: f"{name}: {m}")
    finally:
        pg.destroy()


@pytest.mark.parametrize("world", [2, 4])
def test_attention_block_matches_tp1(gloo, world):
    gloo.run(world, _check_attention_block, False)
    gloo.run(world, _check_attention_block, True)
