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


# -- the activations at the peak: one recompute region materialised again, the loss's temporaries --
V = 1024  # a small vocabulary, so that a recomputed layer, not the loss, is the largest working set
PEAK = {**KORTHIKANTI, "vocab_size": V}


@pytest.mark.parametrize("t", [1, 2])
def test_full_recompute_peak_holds_one_layer_again(compiled, t):
    """Backward of the last layer runs its forward again: the layer's Korthikanti bytes
    s b h (10 + 24/t + 5 a s/(h t)) (no SP) are held again, but for its input (2 s b h, kept by
    the checkpoint throughout), while what the output side kept
    (the final norm's and output layer's inputs, 2 s b h each, and the loss's fp32 softmax,
    4 s b V / t) is already freed; the loss's own temporaries are the other candidate."""
    sbh, logits = S * B * H, S * B * V // t
    plain = _plan(compiled, t, overrides=PEAK)
    plan = _plan(compiled, t, overrides=PEAK, **full())
    layer = sbh * (10 + 24 // t) + 5 * A * S * S * B // t
    assert set(plain.totals["activation_bytes_per_layer"].values()) == {layer}
    loss = (6 if t > 1 else 8) * logits  # runtime/cross_entropy.py at 16-bit (ops/loss.py's working_bytes)
    assert plain.totals["activation_working_bytes"] == loss  # without recompute: the loss alone
    again = layer - 2 * sbh
    assert plan.totals["activation_working_bytes"] == max(loss, again - (2 * sbh + 2 * sbh + 4 * logits))
    assert plan.totals["activation_working_bytes"] > loss


def test_pipeline_stage_peak_and_prediction_memory(compiled):
    """At PP 2 the first stage has no output side: its working set is exactly one layer's
    Korthikanti bytes but its kept input; the prediction's activations are the kept ones in
    flight plus it."""
    from specc.plan.machine import load_machine
    from specc.plan.time import Job, predict

    t, sbh = 2, S * B * H
    plan = build_plan(compiled("gpt.yaml", tp=t, micro_batch_size=B, overrides=PEAK, pp=2, **full())[1])
    first = plan.totals["pipeline"]["stages"][0]
    assert first["activation_working_bytes"] == sbh * (10 + 24 // t) + 5 * A * S * S * B // t - 2 * sbh
    mem = predict(plan, S, load_machine("dgx-a100-80gb"), Job(num_gpus=4, global_batch_size=4 * B))["memory"]
    rank = plan.totals["pipeline"]["stages"][mem["pipeline_rank"]]
    assert mem["activations_kept"] == rank["activation_bytes"] * mem["micro_batches_in_flight"]
    assert mem["activations"] == mem["activations_kept"] + rank["activation_working_bytes"]
