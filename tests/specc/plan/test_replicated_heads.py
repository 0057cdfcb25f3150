"""Grouped-query attention with fewer K/V heads than TP ranks: each head replicated over t/n
ranks (the linear's `heads:`). The plan's per-rank parameters, the zero-padded gradient sum, the
emitted local sizes, and the errors where heads cannot be placed."""

from __future__ import annotations

import pytest

from specc.emit import emit_model
from specc.errors import SpecError
from specc.plan import build_plan, plan_text

H, L, FFN, V = 64, 2, 96, 256  # llama-tiny: hidden, layers, ffn, vocab; 8 query heads of 8


def _llama_params(tp: int, kv_heads: int) -> int:
    """Elements one rank holds of llama-tiny with `kv_heads` K/V heads of 8 features."""
    kv_local = 8 * max(1, kv_heads // tp)  # one whole head when there are fewer heads than ranks
    qkv = (H // tp + 2 * kv_local) * H
    layer = qkv + H * H // tp + 2 * FFN // tp * H + FFN // tp * H + 2 * H
    return L * layer + V // tp * H * 2 + H


@pytest.mark.parametrize("tp,kv", [(1, 2), (2, 2), (4, 2), (4, 1), (8, 2), (2, 4)])
def test_parameters_per_rank(compiled, tp, kv):
    _, g = compiled("llama-tiny.yaml", tp=tp, overrides={"num_query_groups": kv})
    plan = build_plan(g)
    assert plan.totals["parameters"] == _llama_params(tp, kv)
    qkv = next(e for e in plan.entries if e.name.endswith("linear_qkv"))
    assert dict(qkv.weights)["weight"] == (H // tp + 2 * 8 * max(1, kv // tp), H)


def test_replicated_heads_gradient_sum_in_the_tp_sync(compiled):
    _, g = compiled("llama-tiny.yaml", tp=4, sp=True, overrides={"num_query_groups": 2})
    totals = build_plan(g).totals
    padded = L * 2 * (2 * 8) * H  # k and v, each its full 2 heads x 8 rows, per layer
    assert totals["replicated_head_grad_elements"] == padded
    partial = totals["tp_partial_grad_parameters"]  # the norm weights under SP
    assert partial == (2 * L + 1) * H
    assert totals["grad_sync"]["all_reduce"] == {"count": 1, "bytes": (partial + padded) * 4}
    assert f"{padded:,} zero-padded elements" in plan_text(build_plan(g))
    _, whole = compiled("llama-tiny.yaml", tp=2, sp=True, overrides={"num_query_groups": 2})
    assert "replicated_head_grad_elements" not in build_plan(whole).totals  # 2 heads on 2 ranks: none replicated


def test_emitted_local_sizes(compiled):
    _, g = compiled("llama-tiny.yaml", tp=4, overrides={"num_query_groups": 1})
    source = emit_model(g, "specc compile x")
    assert "heads=[8, 1, 1]" in source
    assert "runtime.split(qkv, [16, 8, 8])" in source  # q: 2 of 8 heads, k and v: the one head
    assert "runtime.CoreAttention(2, 1, 8," in source
    values = {op.id: op for op in g.iter_ops()}
    split = next(op for op in values.values() if op.kind == "split")
    assert [g.values[v].units for v in split.outputs] == [(8,), (1,), (1,)]
    assert [g.values[v].local_shape()[-1] for v in split.outputs] == [16, 8, 8]


def test_without_heads_the_linear_is_unchanged(compiled):
    # llama-tiny's 4 KV heads at TP=2: no head replicated, the emitted code as before but the
    # heads keyword the spec now gives
    _, g = compiled("llama-tiny.yaml", tp=2)
    assert "replicated_head_grad_elements" not in build_plan(g).totals
    assert "runtime.CoreAttention(4, 2, 8," in emit_model(g, "specc compile x")


def test_full_width_norm_on_replicated_heads_is_a_located_error(compiled):
    # OLMo2's k_norm normalizes over all K heads: on replicated heads the sum of squares would
    # count each head t/n times, and no boundary gathers replicated heads
    with pytest.raises(SpecError) as e:
        compiled("olmo2-tiny.yaml", tp=4, overrides={"num_query_groups": 2})
    assert "replicated over tensor-parallel ranks" in e.value.what
    assert e.value.loc is not None and e.value.loc.line > 0
    compiled("olmo2-tiny.yaml", tp=2, overrides={"num_query_groups": 2})  # whole heads: fine


def test_per_head_norm_keeps_replicated_heads_sharded(compiled):
    _, g = compiled("qwen3-tiny.yaml", tp=4, overrides={"num_query_groups": 2})
    k_norm = next(op for op in g.iter_ops() if op.id.endswith("k_norm"))
    assert k_norm.in_layouts[0]["tp"] == "S(h)"
