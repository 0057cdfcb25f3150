"""The activation, gated-unit, scale, softcap and norm ops on the mesh: where they run, what they
issue and keep, and what is a located error (issue 13's op library, part A)."""

from __future__ import annotations

import pytest

from specc.compiler import load_and_compile
from specc.emit import emit_model
from specc.errors import SpecError
from specc.frontend.model import Settings
from specc.layouts import SH, SS, I, P
from specc.ops import OPS
from specc.ops.base import Ctx
from specc.plan import build_plan

from ..conftest import spec_path
from .test_parallelize import boundaries


def _op(graph, op_id):
    return next(op for op in graph.iter_ops() if op.id == op_id)


def _entry(plan, name):
    return next(e for e in plan.entries if e.name == name)


def _variant(tmp_path, parent: str, text: str, tp: int = 1, sp: bool = False):
    """Compile a spec that extends specs/PARENT with `text` (YAML)."""
    path = tmp_path / "variant.yaml"
    path.write_text(f"name: variant\nextends: {spec_path(parent)}\n{text}", encoding="utf-8")
    return load_and_compile(str(path), Settings(tp=tp, sp=sp), lint=True)


@pytest.mark.parametrize("tp, sp", [(2, False), (2, True), (4, True)])
def test_full_width_qk_norm_runs_on_head_shards_with_one_all_reduce(compiled, tp, sp):
    """OLMo 2's q/k RMSNorm over the full width stays on the heads' S(h) shards: nothing gathers
    q or k; the norm itself all-reduces one fp32 sum of squares per token, forward and backward."""
    _, g = compiled("olmo2-tiny.yaml", tp=tp, sp=sp, dtype="bf16")
    for name in ("q_norm", "k_norm"):
        op = _op(g, f"layers.0.self_attention.{name}")
        assert op.in_layouts[0]["tp"] == SH and op.out_layouts[0]["tp"] == SH
        assert op.partial_grads == {"tp": ["weight"]}
    assert [b.id for b in boundaries(g, "layers.0.self_attention") if b.attrs["src"] == SH] == []
    plan = build_plan(g)
    tokens = 32  # seq_length x micro_batch_size 1
    entry = _entry(plan, "layers.*.self_attention.q_norm")
    assert list(entry.forward) == [("all_reduce", tokens * 4)] and list(entry.backward) == [("all_reduce", tokens * 4)]
    assert entry.saved == tokens * 64 // tp * 2  # its local bf16 input


def test_per_head_norm_is_local_on_shards_and_its_weight_gradient_partial(compiled):
    _, g = compiled("qwen3-tiny.yaml", tp=4, sp=True)
    for name in ("q_norm", "k_norm"):
        op = _op(g, f"layers.1.self_attention.{name}")
        assert op.in_layouts[0]["tp"] == SH and op.partial_grads == {"tp": ["weight"]}
    plan = build_plan(g)
    entry = _entry(plan, "layers.*.self_attention.k_norm")
    assert list(entry.forward) == [] and list(entry.backward) == []


def test_norms_that_cannot_work_on_shards_gather_first(compiled):
    """A LayerNorm over the full width, and a per-head norm whose heads TP cannot split evenly,
    take their input gathered (S(h) -> I) instead."""
    _, g = compiled("olmo2-tiny.yaml", tp=2, overrides={"modules.SelfAttention.submodules.q_norm.op": "layernorm"})
    assert _op(g, "layers.0.self_attention.q_norm").in_layouts[0]["tp"] == I
    rms, ln = OPS["rmsnorm"], OPS["layernorm"]
    three_heads = {"hidden_size": 48, "head_dim": 16}
    assert SH in rms.rule_tp(three_heads, Ctx(tp=3, sp=False, home=I)).allowed
    assert SH not in rms.rule_tp(three_heads, Ctx(tp=2, sp=False, home=I)).allowed
    assert SH in rms.rule_tp({"hidden_size": 48}, Ctx(tp=2, sp=False, home=I)).allowed
    assert SH not in ln.rule_tp({"hidden_size": 48}, Ctx(tp=2, sp=False, home=I)).allowed


def test_a_per_head_norm_on_a_fused_value_that_cuts_heads_is_a_located_error(tmp_path):
    """A per-head norm (heads of 32) on the fused [q | k | v] (128, 64, 64) at TP=4: each rank's
    slices are 32, 16 and 16 wide, so k and v heads would be cut."""
    _, g = _variant(tmp_path, "qwen3-tiny.yaml", """
modules:
  SelfAttention:
    inputs: [x]
    submodules:
      linear_qkv: {op: linear, parallel: column, bias: false, in_features: 64, out_features: 256, segments: [128, 64, 64]}
      qkv_norm: {op: rmsnorm, hidden_size: 256, head_dim: 32}
      split_qkv: {op: split, sections: [128, 64, 64]}
      q_norm: {op: rmsnorm, hidden_size: 128, head_dim: 16}
      k_norm: {op: rmsnorm, hidden_size: 64, head_dim: 16}
      rotary: {op: rotary, head_dim: 16}
      core_attention: {op: core_attention, num_heads: 8, num_kv_heads: 4, head_dim: 16}
      linear_proj: {op: linear, parallel: row, bias: false, in_features: 128, out_features: 64}
    forward:
      - q, k, v = split_qkv(qkv_norm(linear_qkv(x)))
      - q = rotary(q_norm(q))
      - k = rotary(k_norm(k))
      - context = core_attention(q, k, v)
      - out = linear_proj(context)
      - return out
""", tp=4)
    with pytest.raises(SpecError) as e:
        emit_model(g, "specc compile")
    assert "qkv_norm: normalizes heads of 32, but the tensor-parallel shards of its input are cut by segments " \
           "[128, 64, 64]" in e.value.what


def test_scale_is_linear_and_costs_no_extra_reduction(compiled):
    """Gemma's sqrt(hidden) scale is linear: a partial sum may pass through it (P in, P out), and
    between the vocabulary-parallel embedding and the first norm there is still exactly one
    reduction (a reduce-scatter with SP)."""
    rule = OPS["scale"].rule_tp({"factor": 2.0}, Ctx(tp=2, sp=True, home=SS))
    assert rule.partial_ok and rule.accepts_reduction
    _, g = compiled("gemma-tiny.yaml", tp=2, sp=True)
    op = _op(g, "embedding_scale")
    assert op.attrs["factor"] == 8.0  # ${sqrt(hidden_size)}
    before = [b for b in boundaries(g) if not b.scope.startswith("layers")]
    assert [(b.attrs["src"], b.attrs["dst"]) for b in before if b.attrs["grad"]] == [(P, SS)]


@pytest.mark.parametrize("activation", ["{op: gelu, approximate: tanh}", "{op: relu}", "{op: squared_relu}",
                                        "{op: softcap, cap: 30.0}"])
def test_nonlinear_ops_refuse_partial_sums(tmp_path, activation):
    with pytest.raises(SpecError, match="is not linear, but its input from .* is a partial sum P"):
        _variant(tmp_path, "gpt-tiny.yaml", f"""
modules:
  MLP:
    inputs: [x]
    submodules:
      linear_fc1: {{op: linear, parallel: column, in_features: 64, out_features: 256}}
      linear_fc2: {{op: linear, parallel: row, bias: false, in_features: 256, out_features: 64}}
      activation: {activation}
    forward: ["out = activation(linear_fc2(linear_fc1(x)))", "return out"]
""", tp=2)


def test_gated_units_cut_on_their_halves_or_take_separate_values(compiled, tmp_path):
    # the fused [gate | up] must be sharded segment by segment
    with pytest.raises(SpecError, match=r"splits its input into \[96, 96\], but the tensor-parallel shards"):
        compiled("gemma-tiny.yaml", tp=2, overrides={"modules.MLP.submodules.linear_fc1.segments": [192]})
    # separate gate and up linears: elementwise on both shards
    _, g = _variant(tmp_path, "gemma-tiny.yaml", """
modules:
  MLP:
    inputs: [x]
    submodules:
      gate: {op: linear, parallel: column, bias: false, in_features: 64, out_features: 96}
      up: {op: linear, parallel: column, bias: false, in_features: 64, out_features: 96}
      activation: {op: gated_linear_unit, activation: gelu_tanh}
      linear_fc2: {op: linear, parallel: row, bias: false, in_features: 96, out_features: 64}
    forward: ["out = linear_fc2(activation(gate(x), up(x)))", "return out"]
""", tp=2)
    op = _op(g, "layers.0.mlp.activation")
    assert [lay["tp"] for lay in op.in_layouts] == [SH, SH]
    assert 'runtime.glu(gate_out, up_out, activation="gelu_tanh")' in emit_model(g, "specc compile")


def test_softcap_on_vocabulary_sharded_logits_gathers_nothing(tmp_path):
    _, g = _variant(tmp_path, "gemma-tiny.yaml", """
modules:
  GemmaModel:
    inputs: [tokens, labels]
    submodules:
      embedding: {op: embedding, num_embeddings: 256, embedding_dim: 64}
      embedding_scale: {op: scale, factor: 8.0}
      layers: {module: TransformerLayer, repeat: 2}
      final_norm: {op: rmsnorm, hidden_size: 64, zero_centered_gamma: true}
      output_layer: {op: linear, parallel: column, in_features: 64, out_features: 256, bias: false, tie: embedding}
      logit_softcap: {op: softcap, cap: 30.0}
      loss: {op: cross_entropy}
    forward:
      - h = embedding_scale(embedding(tokens))
      - h = final_norm(layers(h))
      - logits = logit_softcap(output_layer(h))
      - per_token_loss = loss(logits, labels)
      - return per_token_loss
""", tp=4, sp=True)
    assert _op(g, "logit_softcap").in_layouts[0]["tp"] == SH and _op(g, "loss").in_layouts[0]["tp"] == SH
    assert not [b for b in boundaries(g) if b.attrs["src"] == SH]
    with pytest.raises(SpecError, match="softcap cap=0.0 must be above 0"):
        _variant(tmp_path, "llama-tiny.yaml", "modules: {MLP: {submodules: {activation: {op: softcap, cap: 0.0}}}}")


def test_clamp_runs_on_the_head_sharded_fused_qkv_and_refuses_a_bound_of_0(tmp_path):
    """MPT's clip_qkv: the clamp takes the column-parallel QKV's S(h) shards as they come (no
    boundary around it, the split after it cuts them by segments) and emits runtime.clamp; its
    bound must be above 0 (a located error)."""
    _, g = load_and_compile(spec_path("mpt-tiny.yaml"), Settings(tp=4, sp=True), lint=True)
    clamp = _op(g, "layers.0.self_attention.clip_qkv")
    assert clamp.in_layouts[0]["tp"] == SH and clamp.out_layouts[0]["tp"] == SH
    assert not [b for b in boundaries(g, "layers.0.self_attention") if b.attrs["src"] == SH]
    assert "runtime.clamp(linear_qkv_out, 0.5)" in emit_model(g, "specc compile")
    with pytest.raises(SpecError, match="clamp bound=0.0 must be above 0"):
        _variant(tmp_path, "mpt-tiny.yaml", "config: {clip_qkv: 0.0}")
