"""The Plan: activation memory against Korthikanti et al. 2022, collectives against Megatron's
counts, folding of identical layers, and byte-identical output across runs and hash seeds."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from specc.plan import build_plan, plan_json, plan_text
from specc.plan.render import plan_dict

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", ".."))
# GPT-2 124M sizes with dropout on and Megatron's unfused ("local") attention: the setting of
# Korthikanti et al.'s Table 2 accounting (16-bit activations, 1-byte dropout masks).
KORTHIKANTI = {"hidden_dropout": 0.1, "attention_dropout": 0.1,
               "modules.SelfAttention.submodules.core_attention.impl": "unfused"}
S, B, H, A = 1024, 2, 768, 12


def per_layer(plan) -> int:
    per = plan.totals["activation_bytes_per_layer"]
    values = set(per.values())
    assert len(values) == 1, per  # every layer keeps the same
    return values.pop()


def test_activation_memory_matches_korthikanti_without_parallelism(compiled):
    _, g = compiled("gpt.yaml", tp=1, micro_batch_size=B, overrides=KORTHIKANTI)
    assert per_layer(build_plan(g)) == 34 * S * B * H + 5 * A * S * S * B


@pytest.mark.parametrize("t", [2, 4])
def test_activation_memory_matches_korthikanti_with_tp(compiled, t):
    _, g = compiled("gpt.yaml", tp=t, micro_batch_size=B, overrides=KORTHIKANTI)
    assert per_layer(build_plan(g)) == S * B * H * (10 + 24 // t) + 5 * A * S * S * B // t


@pytest.mark.parametrize("t", [2, 4])
def test_activation_memory_matches_korthikanti_with_tp_and_sp(compiled, t):
    _, g = compiled("gpt.yaml", tp=t, sp=True, micro_batch_size=B, overrides=KORTHIKANTI)
    assert per_layer(build_plan(g)) == (34 * S * B * H + 5 * A * S * S * B) // t


def test_fused_attention_keeps_no_score_matrix(compiled):
    _, g = compiled("gpt.yaml", tp=1, micro_batch_size=B)
    plan = build_plan(g)
    # no s x s term: q, k, v, output and the log-sum-exp instead of softmax and dropout buffers
    assert per_layer(plan) < 34 * S * B * H
    swiglu = build_plan(compiled("llama-tiny.yaml", tp=1)[1])
    gelu = build_plan(compiled("gpt-tiny.yaml", tp=1)[1])
    assert per_layer(swiglu) != per_layer(gelu)


def megatron_counts(layers: int, t: int, sp: bool) -> dict:
    """Megatron's collectives for one micro-batch of a GPT with a tied, vocab-parallel output layer."""
    if not sp:
        # per layer: fwd 2 all-reduce (attention, MLP), bwd 2 all-reduce (their inputs' grads);
        # embedding all-reduce, output-layer input grad all-reduce, cross-entropy 2 all-reduces
        return {"all_reduce": 4 * layers + 1 + 1 + 2}
    # per layer: fwd 2 all-gather + 2 reduce-scatter; bwd 2 reduce-scatter + 2 all-gather (reduce-scatter's
    # backward) + 2 all-gather (re-gather of the saved input shard); the embedding reduce-scatter and the
    # position embedding's scatter (bwd all-gather), the output layer's gather, the cross-entropy all-reduces
    return {"all_gather": 6 * layers + 1 + 1 + 2, "reduce_scatter": 4 * layers + 1 + 1, "all_reduce": 2}


@pytest.mark.parametrize("sp", [False, True])
def test_collectives_match_megatron_counts(compiled, sp):
    _, g = compiled("gpt.yaml", tp=2, sp=sp)
    totals = build_plan(g).totals["collectives"]
    counts = {k: v["count"] for k, v in totals.items() if v["count"]}
    assert counts == megatron_counts(12, 2, sp)


def test_collective_bytes_per_layer(compiled):
    _, g = compiled("gpt.yaml", tp=2, sp=True, micro_batch_size=1, dtype="bf16")
    plan = build_plan(g)
    rs = [e for e in plan.entries if e.name.startswith("layers.*") and e.forward and e.forward[0][0] == "reduce_scatter"]
    assert len(rs) == 2 and all(e.count == 12 for e in rs)
    assert all(e.forward[0][1] == 1024 * 1 * 768 * 2 for e in rs)  # the full [s, b, h] tensor in bf16


def test_parameters_and_optimizer_state_per_rank(compiled):
    one = build_plan(compiled("gpt.yaml", tp=1)[1]).totals
    two = build_plan(compiled("gpt.yaml", tp=2)[1]).totals
    assert one["parameters"] == 124_475_904
    # sharded weights halve, replicated ones (norms, positions, row biases) stay
    assert one["parameters"] / 2 < two["parameters"] < one["parameters"] * 0.55
    assert one["optimizer_bytes"] == one["parameters"] * 12  # Adam m, v and fp32 master weights (bf16 training)


def test_text_plan_folds_identical_layers(compiled):
    text = plan_text(build_plan(compiled("gpt.yaml", tp=2, sp=True)[1]))
    assert "layers.*.mlp.linear_fc1  x12" in text
    assert "layers.3." not in text
    assert "layers.* folds 12 identical instances" in text


def test_json_plan_round_trips(compiled):
    plan = build_plan(compiled("llama-tiny.yaml", tp=2, sp=True)[1])
    data = json.loads(plan_json(plan))
    assert data == json.loads(json.dumps(plan_dict(plan)))
    assert data["settings"]["tp"] == 2 and data["spec"]["file"] == "llama-tiny.yaml"
    assert {op["name"] for op in data["ops"]} >= {"embedding", "layers.*.mlp.linear_fc1", "loss"}


def test_plan_is_byte_identical_across_runs_and_hash_seeds():
    outputs = set()
    for seed in ("0", "1", "12345", "random"):
        env = dict(os.environ, PYTHONHASHSEED=seed)
        for args in (["--tp", "2", "--sp"], ["--tp", "4", "--json"]):
            out = subprocess.run([sys.executable, "-m", "specc_cli", "plan", "specs/llama.yaml", *args], cwd=ROOT, env=env,
                                 capture_output=True, text=True, check=True).stdout
            outputs.add((tuple(args), out))
    assert len(outputs) == 2  # one text per set of flags, whatever the hash seed


def test_text_plan_says_why_each_implementation_was_chosen(compiled):
    text = plan_text(build_plan(compiled("parallel-block-tiny.yaml", tp=2, sp=True)[1]))
    why = text.split("implementations (why each was chosen)\n", 1)[1]
    assert "auto: transformer_engine not installed" in why  # linears and norms could have used TE
    assert "auto: transformer_engine and flash_attn not installed" in why  # attention
    assert "merges partial sums before one reduction" in why  # the parallel block's merged sum
