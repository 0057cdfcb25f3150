"""Context parallelism in the plan: the sequence sharded outside attention, attention's own K/V
traffic counted exactly, activation memory per rank divided by CP, cp-partial gradients."""

from __future__ import annotations

import pytest

from specc.errors import SpecError
from specc.ops import OPS
from specc.plan import build_plan


def _boundaries(graph, axis):
    return [op for op in graph.iter_ops() if OPS[op.kind].converts() and op.attrs["axis"] == axis]


@pytest.mark.parametrize("name", ["gpt-tiny.yaml", "llama-tiny.yaml", "parallel-block-tiny.yaml"])
@pytest.mark.parametrize("tp,sp", [(1, False), (2, False), (2, True)])
def test_activation_memory_per_rank_halves_at_cp2(compiled, name, tp, sp):
    one = build_plan(compiled(name, tp=tp, sp=sp)[1]).totals["activation_bytes"]
    two = build_plan(compiled(name, tp=tp, sp=sp, cp=2, cp_comm_type="p2p")[1]).totals["activation_bytes"]
    four = build_plan(compiled(name, tp=tp, sp=sp, cp=4, cp_comm_type="p2p")[1]).totals["activation_bytes"]
    assert two * 2 == one and four * 4 == one  # with the ring everything kept for backward is per token


@pytest.mark.parametrize("cp", [2, 4])
def test_the_all_gather_keeps_the_gathered_kv_and_its_mask(compiled, cp):
    """The all-gather attention keeps K and V of the whole sequence (not the rank's share) and its
    mask of the rank's queries against every key: [s/cp, s] by position, [b, s/cp, s] with
    document ids; the ring keeps neither (its block masks are rebuilt in backward)."""
    def extra(name, per_layer_mask, kv, **settings):
        plans = [build_plan(compiled(name, cp=cp, cp_comm_type=comm, dtype="fp32", micro_batch_size=b,
                                     **settings)[1]).totals["activation_bytes"] for comm in ("all_gather", "p2p")]
        return plans[0] - plans[1], 2 * (2 * b * kv * (s - s // cp) * 4 + per_layer_mask)

    b, s = 2, 32
    assert len(set(extra("llama-tiny.yaml", s // cp * s, 32))) == 1  # causal: 4 kv heads x 8
    assert len(set(extra("mistral-tiny.yaml", s // cp * s, 32))) == 1  # causal, window
    assert len(set(extra("bert-tiny.yaml", b * s // cp * s, 64))) == 1  # bidirectional, documents


def test_only_inputs_and_outputs_cross_the_cp_axis(compiled):
    _, g = compiled("gpt-tiny.yaml", tp=2, sp=True, cp=2)
    conversions = [(op.inputs[0], op.attrs["src"], op.attrs["dst"]) for op in _boundaries(g, "cp")]
    assert conversions == [("tokens", "I", "S(s)"), ("labels", "I", "S(s)"), ("loss", "S(s)", "I")]
    for op in g.iter_ops():  # between them every value is sequence-sharded over cp
        if not OPS[op.kind].converts():
            assert all(lay["cp"] == "S(s)" for lay in op.in_layouts + op.out_layouts), op.id
    assert str(g.values[g.outputs[0]].layout) == "I"


def test_ring_attention_traffic_is_counted_per_layer(compiled):
    spec, g = compiled("gpt-tiny.yaml", cp=4, dtype="fp32", micro_batch_size=2)
    plan = build_plan(g)
    attn = next(e for e in plan.entries if e.kind == "core_attention")
    s, b, h = 32, 2, 64  # full sequence, batch, hidden (heads x head_dim: all heads at TP=1)
    kv_block = 2 * (s // 4) * b * h * 4  # this rank's k and v, fp32
    assert attn.forward == [("send", kv_block), ("recv", kv_block)] * 3  # N-1 steps
    assert attn.backward == [("send", kv_block), ("recv", kv_block)] * 7  # K/V again, dK/dV home: 2N-1
    assert plan.totals["collectives"]["send"] == {"count": 2 * 10, "bytes": 2 * 10 * kv_block}
    assert any("cp p2p" in n for n in attn.notes)


def test_grouped_query_attention_all_gathers_kv_and_pins_win(compiled):
    _, g = compiled("llama-tiny.yaml", cp=2, dtype="fp32", micro_batch_size=2)
    attn = next(op for op in g.iter_ops() if op.kind == "core_attention")
    assert attn.attrs["cp_comm_type_resolved"] == "all_gather"
    fwd, bwd = OPS["core_attention"].collectives(attn, lambda axis: [(32, 2, 64), (32, 2, 32), (32, 2, 32)], 4, g.mesh)
    assert [k for k, _ in fwd] == ["all_gather", "all_gather"] and [k for k, _ in bwd] == ["reduce_scatter"] * 2
    _, pinned = compiled("llama-tiny.yaml", cp=2, cp_comm_type="p2p")
    attn = next(op for op in pinned.iter_ops() if op.kind == "core_attention")
    assert (attn.attrs["cp_comm_type_resolved"], attn.attrs["cp_comm_reason"]) == ("p2p", "pinned by --cp-comm-type")


@pytest.mark.parametrize("seq,cp,kind", [(8192, 8, "all_gather"), (32768, 8, "all_gather"),
                                         (131072, 8, "p2p"), (131072, 32, "all_gather")])
def test_long_sequences_leave_the_all_gather_for_the_ring(compiled, seq, cp, kind):
    """The all-gather keeps a [S/N, S] mask a layer for backward: past the point where it outweighs
    the K/V gathered (2 S b kv_heads head_dim bytes), the cost model picks the ring even for
    grouped-query attention (at 128K over 8 ranks it kept 2 GiB a layer and was still chosen)."""
    _, g = compiled("llama3.yaml", cp=cp, overrides={"seq_length": seq})
    attn = next(op for op in g.iter_ops() if op.kind == "core_attention")
    mask = (seq // cp) * seq
    gathered = 2 * seq * 8 * 128 * 2  # Llama 3 8B: 8 K/V heads of 128, bf16, micro-batch 1
    assert (mask > gathered) == (kind == "p2p")
    assert attn.attrs["cp_comm_type_resolved"] == kind, attn.attrs["cp_comm_reason"]
    if kind == "p2p":
        assert attn.attrs["cp_comm_reason"] == (f"grouped-query attention, but at {seq} tokens the all-gather's mask "
                                                f"({mask >> 20:,} MiB a layer) would outweigh the K/V it gathers "
                                                f"({gathered >> 20:,} MiB)")


def test_every_parameter_gets_a_cp_partial_gradient(compiled):
    _, g = compiled("llama-tiny.yaml", tp=2, sp=True, cp=2)
    totals = build_plan(g).totals
    assert totals["cp_partial_grad_parameters"] == totals["parameters"]
    assert totals["grad_sync"]["all_reduce"]["count"] == 2  # one all-reduce over tp, one over cp


def test_token_ids_carry_no_gradient_traffic(compiled):
    _, g = compiled("gpt-tiny.yaml", cp=2)
    plan = build_plan(g)
    scatter = [e for e in plan.entries if e.name.startswith(("tokens:", "labels:"))]
    assert len(scatter) == 2 and all(e.forward == [] and e.backward == [] for e in scatter)


def test_sequence_must_divide_into_two_chunks_per_rank(compiled):
    with pytest.raises(SpecError) as e:
        compiled("gpt-tiny.yaml", cp=3)
    assert "not divisible by 2 x context-parallel size 3" in e.value.format()
    assert e.value.loc is not None


def test_cp1_plans_match_the_single_axis_text(compiled):
    """At CP=1 layouts print as before the mesh redesign: one bare placement per value."""
    _, g = compiled("gpt-tiny.yaml", tp=2, sp=True)
    assert all("/" not in str(lay) for op in g.iter_ops() for lay in op.in_layouts + op.out_layouts)


def test_diff_rebuilds_generated_folders_from_their_recorded_settings(capsys, monkeypatch):
    import os

    from specc_cli.main import main

    monkeypatch.chdir(os.path.join(os.path.dirname(__file__), "..", "..", ".."))
    assert main(["diff", "generated/gpt_tp2_sp", "generated/gpt_tp2_sp_cp2"]) == 1
    out = capsys.readouterr().out
    assert out.splitlines()[0] == "--- generated/gpt_tp2_sp (specc compile specs/gpt.yaml --tp 2 --sp)"
    assert "settings: cp 1 -> 2" in out
    assert main(["diff", "generated/gpt_tp2_sp", "generated/gpt_tp2_sp"]) == 0


@pytest.mark.parametrize("comm,pairs,computed", [("p2p", 3 * 8 * 8 + 2 * 8 * 8 // 2, 5 * 8 * 8),
                                                  ("all_gather", 16 * 32, 16 * 32)])
def test_cp_blocks_are_batched_gemms_over_scores_in_memory(compiled, comm, pairs, computed):
    """runtime/context_parallel.py computes each block's scores in memory in fp32 with torch.matmul:
    the plan times its FLOPs as batched GEMMs and charges 10 passes over the scores forward, 18 backward,
    4 bytes each (llama-tiny: no dropout). flops() counts the pairs the mask keeps: at CP 2 on s = 32 the
    ring's load-balanced chunks of 8 give 3 whole chunk pairs and 2 diagonal ones per rank (half
    of each, Megatron's convention), the all-gather its 16 x 32 rectangle. The time model takes the
    pairs the blocks compute: the ring's first step computes 3 of the local 16 x 16 block's 4 chunk
    pairs (the diagonal ones whole, the wholly masked one skipped), its second half a block (2),
    and backward recomputes Q K^T."""
    plan = build_plan(compiled("llama-tiny.yaml", cp=2, cp_comm_type=comm, dtype="bf16", micro_batch_size=2)[1])
    attn = [e for e in plan.entries if e.kind == "core_attention"]
    one = build_plan(compiled("llama-tiny.yaml", dtype="bf16", micro_batch_size=2)[1])
    fused = [e for e in one.entries if e.kind == "core_attention"]
    assert attn and fused and all(e.kernel == "cp_blocks" for e in attn) and all(e.kernel == "attention" for e in fused)
    assert all(e.memory == (0, 0) for e in fused) and all(e.kernel_flops == () for e in fused)  # SDPA: on chip
    head_dim = 64 // 8
    scores, run = 2 * 8 * pairs, 2 * 8 * computed  # batch x heads x pairs
    assert all(e.flops == (2 * scores * 2 * head_dim, 4 * scores * 2 * head_dim) for e in attn)
    assert all(e.kernel_flops == (2 * run * 2 * head_dim, 4 * run * 2 * head_dim + 2 * run * head_dim) for e in attn)
    assert all(e.memory == (10 * 4 * run, 18 * 4 * run) for e in attn)
