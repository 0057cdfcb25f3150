"""The plan's FLOP count of a training step against the closed form (Narayanan et al. 2021, the
Megatron-LM paper's eq. 3, with causal attention counted as the fused kernels compute it):

    FLOPs per step = 6 * N * T + 12 * l * b * s^2 * h * c

N: the weights of the matrix multiplies (12 l h^2 in the layers, plus the tied output layer's
V h: it is a GEMM, while the embedding lookups are not), T = b * s tokens, c = 1/2 for causal
attention in a fused kernel (the blocks above the diagonal are skipped) and 1 for the unfused
path (the full s x s scores are multiplied, then masked). Biases, norms, GELU, softmax and the
cross-entropy are not matrix multiplies and are not counted (docs/training.md)."""

from __future__ import annotations

import os
from fractions import Fraction

import pytest

from specc.compiler import load_and_compile
from specc.frontend.model import Settings
from specc.plan import build_plan

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", ".."))
GPT = os.path.join(ROOT, "specs", "gpt.yaml")


def _plan(b=2, **settings):
    _, graph = load_and_compile(GPT, Settings(micro_batch_size=b, **settings))
    return build_plan(graph)


def closed_form(config: dict, b: int, causal_fraction: Fraction) -> int:
    h, layers, s, v = config["hidden_size"], config["num_layers"], config["seq_length"], config["vocab_size"]
    ffn = config["ffn_hidden_size"]
    n = layers * (3 * h * h + h * h + 2 * h * ffn) + v * h  # qkv, proj, fc1, fc2; the tied output layer
    t = b * s
    attention = 12 * layers * b * s * s * h * causal_fraction
    assert attention.denominator == 1
    return 6 * n * t + int(attention)


def test_gpt_step_flops_match_6NT_plus_attention():
    plan = _plan(b=2)
    spec, _ = load_and_compile(GPT, Settings(micro_batch_size=2))
    config = spec.config
    assert config["ffn_hidden_size"] == 4 * config["hidden_size"]  # so N = 12 l h^2 + V h
    total = plan.totals["flops_per_step"]
    assert total == closed_form(config, 2, Fraction(1, 2))
    assert total == 817_184_636_928 * 2  # the 124M model at s = 1024, b = 2
    fwd, bwd = plan.totals["flops"]["forward"], plan.totals["flops"]["backward"]
    assert bwd == 2 * fwd and fwd + bwd == total


def test_unfused_attention_counts_the_whole_score_matrix():
    plan = _plan(b=1, backend="unfused")
    spec, _ = load_and_compile(GPT, Settings())
    assert plan.totals["flops_per_step"] == closed_form(spec.config, 1, Fraction(1))


@pytest.mark.parametrize("settings", [dict(tp=2), dict(tp=4, sp=True), dict(cp=2), dict(tp=2, cp=2)])
def test_per_rank_flops_are_the_step_divided_by_the_ranks(settings):
    """Every GEMM of GPT is sharded over TP (heads, features, vocabulary) and every token-wise op
    and causal attention over CP in load-balanced chunks: each rank does 1/(tp*cp) of the work,
    and an absorbed sequence gather does not hide the gathered rows."""
    whole = _plan(b=1).totals["flops_per_step"]
    ranks = settings.get("tp", 1) * settings.get("cp", 1)
    assert _plan(b=1, **settings).totals["flops_per_step"] * ranks == whole


def test_plan_json_carries_per_op_flops_and_weight_shapes():
    from specc.plan.render import plan_dict

    d = plan_dict(_plan(b=1, tp=2))
    ops = {o["name"]: o for o in d["ops"]}
    qkv = ops["layers.*.self_attention.linear_qkv"]
    assert qkv["weights"] == {"weight": [1152, 768], "bias": [1152]}
    assert qkv["flops"] == {"forward": 2 * 1024 * 768 * 1152, "backward": 4 * 1024 * 768 * 1152}
    assert sum((o["flops"]["forward"] + o["flops"]["backward"]) * o["count"] for o in d["ops"]) \
        == d["totals"]["flops_per_step"]


# -- masked attention ---------------------------------------------------------------------------
# One layer's attention FLOPs on one rank: 3 (forward + backward) * 2 * 2 * b * pairs * h (all
# heads at TP=1), over the (query, key) pairs the implementation computes.
ATTENTION = "modules.SelfAttention.submodules.core_attention."


def _attention_pairs(overrides=(), **settings):
    """(query, key) pairs one rank's attention computes per layer, from the plan's FLOPs."""
    from specc.errors import Loc

    located = [(ATTENTION + k, v, Loc("--set")) for k, v in overrides]
    spec, graph = load_and_compile(GPT, Settings(micro_batch_size=1, **settings), located)
    entry = next(e for e in build_plan(graph).entries if e.kind == "core_attention")
    forward, backward = entry.flops
    assert backward == 2 * forward and forward % (4 * spec.config["hidden_size"]) == 0
    return forward // (4 * spec.config["hidden_size"])


S = 1024  # gpt.yaml's sequence


@pytest.mark.parametrize("overrides, settings, pairs", [
    ((), {}, S * S // 2),  # causal, SDPA's is_causal: the tiles above the diagonal skipped
    ((("causal", False),), {}, S * S),  # bidirectional
    ((("window", 128),), {}, S * S),  # an explicit mask: SDPA computes every pair, then masks
    ((("softcap", 30.0),), {}, S * S),  # soft-capping runs the unfused path
    ((), {"backend": "unfused"}, S * S),
    ((), {"cp": 2}, S * S // 4),  # the ring: each rank half of CP=1's s^2/2
    ((), {"cp": 4, "cp_comm_type": "p2p"}, S * S // 8),
    ((), {"cp": 2, "cp_comm_type": "all_gather"}, S * S // 2),  # the rank's queries x every key, masked after
    ((("causal", False),), {"cp": 4}, S * S // 4),
    # a window no longer than a chunk (c = S / 2N): a query chunk keeps its own chunk (causal:
    # counted half, the diagonal) and the one before it: 2N halves + 2(2N - 1) whole chunk pairs
    ((("window", 128),), {"cp": 2}, (3 * 2 - 1) * (S // 4) ** 2 // 2),
    ((("window", 128),), {"cp": 4}, (3 * 4 - 1) * (S // 8) ** 2 // 4),
    # bidirectional: its own chunk and both neighbours, all whole
    ((("window", 100), ("causal", False)), {"cp": 4}, 2 * (3 * 4 - 1) * (S // 8) ** 2 // 4),
    ((("window", S),), {"cp": 4}, S * S // 8),  # a window as long as the sequence masks nothing
])
def test_masked_attention_counts_the_pairs_it_computes(overrides, settings, pairs):
    assert _attention_pairs(overrides, **settings) == pairs


@pytest.mark.parametrize("n", [2, 3, 4])
def test_ring_pairs_match_a_brute_force_count(n):
    """cp_pairs against counting, over every chunk pair of the 2N, whether any (query, key) pair in
    it is kept (computed whole; a causal diagonal counted half), averaged over the N ranks."""
    from specc.ops.attention import cp_pairs

    c = 4
    for causal in (True, False):
        for window in (None, 1, 2, 3, 4, 5, 9, 100):
            halves = 0
            for m in range(2 * n):
                for k in range(2 * n):
                    kept = any((not causal or j <= i) and (window is None or abs(i - j) < window)
                               for i in range(m * c, (m + 1) * c) for j in range(k * c, (k + 1) * c))
                    halves += kept * (1 if causal and m == k else 2)
            assert cp_pairs(2 * c, n, "p2p", causal, window) == halves * c * c // (2 * n), (n, causal, window)
            assert cp_pairs(2 * c, n, "all_gather", causal, window) == 2 * c * 2 * c * n


def megatron_flops(c: dict, b: int) -> int:
    """Megatron-LM's num_floating_point_operations (megatron/training/training.py) for a decoder
    of c's sizes, causal attention (s / 2h), MoE or dense, gated or not: 12 b s l h^2 times the
    attention, MLP and logit terms, exactly, in integers."""
    h, layers, s, v = c["hidden_size"], c["num_layers"], c["seq_length"], c["vocab_size"]
    heads = c["num_attention_heads"]
    groups = c.get("num_query_groups", heads)
    q = heads * c.get("head_dim", h // heads)
    gated = Fraction(3, 2) if c.get("swiglu", True) else 1
    routed = c.get("moe_router_topk", 1)
    ffn = c.get("moe_ffn_hidden_size", c.get("ffn_hidden_size"))
    shared = c.get("moe_shared_expert_intermediate_size") or 0
    attention = (1 + Fraction(groups, heads) + Fraction(s, 2 * h)) * Fraction(q, h)
    mlp = Fraction(ffn, h) * routed * gated + Fraction(shared, h) * gated
    total = 12 * b * s * layers * h * h * (attention + mlp + Fraction(v, 2 * layers * h))
    assert total.denominator == 1
    return int(total)


@pytest.mark.parametrize("name,ep", [("mixtral", 1), ("mixtral", 8), ("llama3", 1)])
def test_moe_and_gqa_swiglu_flops_equal_megatrons_formula(name, ep):
    """The MoE op counts its experts' GEMMs (each token's top-k rows and the shared experts; per
    rank its own tokens' rows under EP, as Megatron counts per GPU): a Mixtral step's FLOPs are
    Megatron's to the FLOP, as a dense GQA/SwiGLU model's are (the MoE op counted none before)."""
    spec, graph = load_and_compile(os.path.join(ROOT, "specs", f"{name}.yaml"), Settings(micro_batch_size=1, ep=ep))
    assert build_plan(graph).totals["flops_per_step"] == megatron_flops(spec.config, 1)
