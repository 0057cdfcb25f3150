"""The plan under activation recompute (Korthikanti et al. 2022's accounting, 16-bit, 1-byte
masks): selective recompute removes exactly the 5as²b term of every layer, full recompute leaves
a layer its input alone (2sbh, /t with SP); the recomputed forward's collectives run again in
backward and its FLOPs are shown; Megatron's uniform and block methods pick the layers."""

from __future__ import annotations

import pytest

from specc.plan import build_plan, plan_text

S, B, H, A, L = 1024, 2, 768, 12, 12
KORTHIKANTI = {"hidden_dropout": 0.1, "attention_dropout": 0.1,
               "modules.SelfAttention.submodules.core_attention.impl": "unfused"}
SELECTIVE = {"recompute_granularity": "selective"}


def full(method="uniform", n=1):
    return {"recompute_granularity": "full", "recompute_method": method, "recompute_num_layers": n}


def _plan(compiled, t=1, sp=False, name="gpt.yaml", overrides=KORTHIKANTI, **recompute):
    return build_plan(compiled(name, tp=t, sp=sp, micro_batch_size=B, overrides=overrides, **recompute)[1])


@pytest.mark.parametrize("t,sp", [(1, False), (2, True), (4, True)])
def test_selective_recompute_removes_the_5as2b_term(compiled, t, sp):
    plan = _plan(compiled, t, sp, **SELECTIVE)
    assert set(plan.totals["activation_bytes_per_layer"].values()) == {34 * S * B * H // t}
    # the attention core's own softmax, mask and dropout output are gone; q, k, v are its inputs
    core = next(e for e in plan.entries if e.kind == "core_attention")
    assert core.saved == 3 * S * B * H * 2 // t and "recompute selective" in "; ".join(core.notes)


@pytest.mark.parametrize("t,sp", [(1, False), (2, True)])
def test_full_recompute_keeps_each_layer_its_input(compiled, t, sp):
    plain, plan = _plan(compiled, t, sp), _plan(compiled, t, sp, **full())
    assert set(plan.totals["activation_bytes_per_layer"].values()) == {2 * S * B * H // t}
    # the rest of the model (embedding, final norm, output layer, loss) keeps what it kept
    outside = plain.totals["activation_bytes"] - sum(plain.totals["activation_bytes_per_layer"].values())
    assert plan.totals["activation_bytes"] == outside + L * 2 * S * B * H // t
    # the forward runs twice: every forward collective of a layer runs again in backward
    counts = {k: v["count"] for k, v in plan.totals["collectives"].items()}
    before = {k: v["count"] for k, v in plain.totals["collectives"].items()}
    layer_forward = {}
    for e in plain.entries:
        if e.name.startswith("layers."):
            for kind, _ in e.forward:
                layer_forward[kind] = layer_forward.get(kind, 0) + e.count
    assert counts == {k: before[k] + layer_forward.get(k, 0) for k in before}
    assert (t > 1) == bool(layer_forward)
    # and its matmuls: the recompute FLOPs are the layers' forward FLOPs
    assert plan.totals["recompute_flops"] == sum(e.flops[0] * e.count for e in plain.entries if e.name.startswith("layers."))
    assert plan.totals["flops_per_step"] == plain.totals["flops_per_step"]  # model FLOPs: unchanged
    assert "recompute FLOPs" in plan_text(plan) and "recompute FLOPs" not in plan_text(plain)


def test_uniform_groups_and_block_prefix(compiled):
    layer_input = 2 * S * B * H
    plain = set(_plan(compiled).totals["activation_bytes_per_layer"].values()).pop()
    uniform = _plan(compiled, **full("uniform", 5)).totals["activation_bytes_per_layer"]
    # groups of 5 consecutive layers (the last one shorter: 5, 5, 2) each keep their first input
    assert uniform == {"layers.0": layer_input, "layers.5": layer_input, "layers.10": layer_input}
    block = _plan(compiled, **full("block", 3)).totals["activation_bytes_per_layer"]
    assert block == {f"layers.{i}": layer_input if i < 3 else plain for i in range(L)}


def test_spec_declared_recompute(compiled):
    mlp = compiled("gpt.yaml", micro_batch_size=B, overrides={**KORTHIKANTI, "modules.MLP.recompute": "full"})[1]
    # the MLP keeps its input (the norm's output, which the norm keeps too: it counts once) and
    # nothing of its own: not fc1's input, GELU's input (4h wide) nor fc2's input (4h wide)
    per = set(build_plan(mlp).totals["activation_bytes_per_layer"].values()).pop()
    plain = set(_plan(compiled).totals["activation_bytes_per_layer"].values()).pop()
    assert plain - per == 2 * (2 * S * B * 4 * H)
    attn = compiled("gpt.yaml", micro_batch_size=B,
                    overrides={**KORTHIKANTI, "modules.TransformerLayer.recompute": "selective"})[1]
    assert set(build_plan(attn).totals["activation_bytes_per_layer"].values()) == {34 * S * B * H}
    # a module recomputed whole inside a recomputed layer adds nothing: the layer keeps its input
    both = compiled("gpt.yaml", micro_batch_size=B, overrides={**KORTHIKANTI, "modules.MLP.recompute": "full"},
                    **full())[1]
    assert set(build_plan(both).totals["activation_bytes_per_layer"].values()) == {2 * S * B * H}
    assert len(both.recompute.regions) == L
