"""Layout inference finds Megatron's optimum on standard layers, and better on a parallel block."""

from __future__ import annotations

import os

import pytest

from specc.errors import SpecError
from specc.layouts import SH, SS, I, P, R
from specc.ops import OPS
from specc.ops.base import EmitCtx

SPECS = os.path.join(os.path.dirname(__file__), "..", "..", "..", "specs")


def boundaries(graph, scope_prefix=""):
    return [op for op in graph.iter_ops() if OPS[op.kind].converts() and op.scope.startswith(scope_prefix)]


def tp_layouts(layouts):
    """The tp placements of a list of per-axis layouts."""
    return [lay["tp"] for lay in layouts]


def layer_collectives(graph, layer="layers.0"):
    """(forward, backward) collectives issued inside one layer, boundaries and absorbed ones."""
    fwd, bwd = [], []
    for op in graph.iter_ops():
        if not (op.scope == layer or op.scope.startswith(layer + ".")):
            continue
        if OPS[op.kind].converts():
            b = OPS[op.kind].boundary(op)
            fwd += [b.forward] if b.forward in ("all_reduce", "all_gather", "reduce_scatter") else []
            bwd += [b.backward] if b.backward in ("all_reduce", "all_gather", "reduce_scatter") else []
        for a in op.absorbed:
            if a.mode == "gather":
                fwd.append("all_gather")
                bwd += ["all_gather", "reduce_scatter"]
            else:
                bwd.append("all_reduce")
    return sorted(fwd), sorted(bwd)


def test_gpt_tp2_without_sp_is_megatron_tp(compiled):
    _, g = compiled("gpt.yaml", tp=2)
    fwd, bwd = layer_collectives(g)
    # one forward all-reduce after attention and one after the MLP; their backward mirror
    assert fwd == ["all_reduce", "all_reduce"]
    assert bwd == ["all_reduce", "all_reduce"]
    reduces = [op for op in boundaries(g, "layers.0") if OPS[op.kind].boundary(op).src == P]
    assert [op.scope for op in reduces] == ["layers.0.self_attention", "layers.0.mlp"]


def test_gpt_tp2_with_sp_is_megatron_sp(compiled):
    _, g = compiled("gpt.yaml", tp=2, sp=True)
    fwd, bwd = layer_collectives(g)
    # an all-gather into, and a reduce-scatter out of, each of the two blocks; no all-reduce
    assert fwd == ["all_gather", "all_gather", "reduce_scatter", "reduce_scatter"]
    assert "all_reduce" not in bwd
    for op in g.iter_ops():
        if op.scope.startswith("layers.") and op.kind in ("layernorm", "dropout", "add"):
            assert op.in_layouts[0]["tp"] == SS, op.id


def test_parallel_block_reduces_once_per_layer(compiled):
    for sp in (False, True):
        _, g = compiled("parallel-block.yaml", tp=2, sp=sp)
        fwd, _ = layer_collectives(g)
        reductions = [c for c in fwd if c in ("all_reduce", "reduce_scatter")]
        assert len(reductions) == 1, (sp, fwd)
        merged = [op for op in g.iter_ops() if op.scope == "layers.0" and op.kind == "add" and tp_layouts(op.in_layouts) == [P, P]]
        assert len(merged) == 1


def test_tp1_has_no_collectives(compiled):
    for name in ("gpt.yaml", "llama.yaml", "parallel-block.yaml"):
        _, g = compiled(name, tp=1, sp=True)
        assert not boundaries(g)
        assert all(not op.absorbed for op in g.iter_ops())
        assert all(set(map(str, op.in_layouts)) <= {I} for op in g.iter_ops())


def test_tp4_with_six_heads_is_a_located_error(compiled):
    with pytest.raises(SpecError) as e:
        compiled("gpt.yaml", tp=4, overrides={"num_attention_heads": 6})
    assert "num_heads=6 is not divisible by tensor-model-parallel size 4" in e.value.what
    assert e.value.loc.path.endswith("gpt.yaml") and e.value.loc.line > 0 and e.value.loc.col > 0


@pytest.mark.parametrize("key,value,what", [
    ("vocab_size", 50257, "num_embeddings=50257"),
    ("ffn_hidden_size", 3071, "out_features=3071"),
])
def test_sizes_not_divisible_by_tp(compiled, key, value, what):
    with pytest.raises(SpecError) as e:
        compiled("gpt.yaml", tp=2, overrides={key: value})
    assert what in e.value.what


def test_llama_kv_heads_and_sequence_divisibility(compiled):
    # 8 KV heads at TP=16: each replicated over 2 ranks (tests/specc/plan/test_replicated_heads.py)
    _, g = compiled("llama.yaml", tp=16)
    attn = next(op for op in g.iter_ops() if op.kind == "core_attention")
    assert g.values[attn.inputs[1]].units == (8,)
    with pytest.raises(SpecError) as e:
        compiled("llama-tiny.yaml", tp=2, sp=True, overrides={"seq_length": 31})
    assert "sequence length 31" in e.value.what


def test_sequence_parallel_marks_partial_grads(compiled):
    _, g = compiled("gpt.yaml", tp=2, sp=True)
    marked = {op.id: op.partial_grad for op in g.iter_ops() if op.partial_grad}
    assert marked["layers.0.input_layernorm"] == ["weight", "bias"]
    assert marked["layers.0.mlp.linear_fc2.bias"] == ["bias"]  # row-parallel bias added to S(s)
    assert marked["final_layernorm"] == ["weight", "bias"]
    _, g = compiled("gpt.yaml", tp=2, sp=False)
    assert not [op for op in g.iter_ops() if op.partial_grad]


def test_tied_output_layer_shares_the_embedding(compiled):
    _, g = compiled("gpt.yaml", tp=2, sp=True)
    assert g.ops["output_layer"].tied_to == "embedding"
    _, g = compiled("llama.yaml", tp=2)
    assert g.ops["output_layer"].tied_to is None


def test_fused_weights_shard_per_segment(compiled):
    _, g = compiled("llama-tiny.yaml", tp=2)
    split = g.ops["layers.0.self_attention.split_qkv"]
    assert tp_layouts(split.in_layouts) == [SH]
    call = OPS["split"].call(split, ["qkv"], EmitCtx(tp=2))
    assert call == "runtime.split(qkv, [32, 16, 16])"  # q, k, v halves of [64, 32, 32]


def test_a_fused_weight_without_segments_is_an_error(tmp_path):
    from specc.compiler import load_and_compile
    from specc.frontend.model import Settings

    spec = tmp_path / "slab.yaml"
    spec.write_text(f"""name: slab
extends: {os.path.join(SPECS, "llama-tiny.yaml")}
modules:
  MLP:
    inputs: [x]
    submodules:
      linear_fc1: {{op: linear, parallel: column, bias: false, in_features: 64, out_features: 192}}
      activation: {{op: swiglu}}
      linear_fc2: {{op: linear, parallel: row, bias: false, in_features: 96, out_features: 64}}
    forward:
      - h = linear_fc1(x)
      - h = activation(h)
      - out = linear_fc2(h)
      - return out
""")
    with pytest.raises(SpecError) as e:
        load_and_compile(str(spec), Settings(tp=2))
    assert "one slab" in e.value.what and "segments: [96, 96]" in e.value.hint
    assert e.value.loc.path == str(spec) and e.value.loc.line == 12
    load_and_compile(str(spec), Settings(tp=1))  # one rank holds the whole slab: fine


def test_vocab_parallel_cross_entropy_takes_sharded_logits(compiled):
    _, g = compiled("gpt.yaml", tp=2, sp=True)
    assert tp_layouts(g.ops["loss"].in_layouts) == [SH, I]  # never gathered: that would add log(t)


def test_no_fuse_keeps_boundaries_visible(compiled):
    _, g = compiled("gpt.yaml", tp=2, sp=True, fuse=False)
    qkv_in = [op for op in boundaries(g, "layers.0.self_attention")]
    assert any(OPS[op.kind].boundary(op).src == SS and OPS[op.kind].boundary(op).dst == R for op in qkv_in)
    assert not any(op.absorbed for op in g.iter_ops())


def test_row_parallel_output_into_a_nonlinearity_is_a_located_error(tmp_path):
    spec = tmp_path / "bad.yaml"
    spec.write_text(BAD_ROW_INTO_GELU)
    from specc.compiler import load_and_compile
    from specc.frontend.model import Settings

    with pytest.raises(SpecError) as e:
        load_and_compile(str(spec), Settings(tp=2))
    assert "cannot type" in e.value.what and "gelu" in e.value.what and "partial sum P" in e.value.what
    assert e.value.loc.line == 21  # the step `h = act(h)`
    load_and_compile(str(spec), Settings(tp=1))  # fine without tensor parallelism


BAD_ROW_INTO_GELU = """\
name: bad
model:
  module: M
  inputs:
    tokens: {shape: [1, 8], dtype: int64}
    labels: {shape: [1, 8], dtype: int64}
modules:
  M:
    inputs: [tokens, labels]
    submodules:
      emb: {op: embedding, num_embeddings: 16, embedding_dim: 8}
      up: {op: linear, parallel: column, in_features: 8, out_features: 16}
      down: {op: linear, parallel: row, in_features: 16, out_features: 8, bias: false}
      act: {op: gelu}
      head: {op: linear, parallel: column, in_features: 8, out_features: 16}
      loss: {op: cross_entropy}
    forward:
      - h = emb(tokens)
      - h = up(h)
      - h = down(h)
      - h = act(h)
      - logits = head(h)
      - l = loss(logits, labels)
      - return l
"""


def test_parallel_block_with_biases_still_reduces_once(compiled):
    biases = {"modules.SelfAttention.submodules.linear_proj.bias": True,
              "modules.MLP.submodules.linear_fc2.bias": True}
    for sp in (False, True):
        _, g = compiled("parallel-block.yaml", tp=2, sp=sp, overrides=biases)
        fwd, _ = layer_collectives(g)
        assert len([c for c in fwd if c in ("all_reduce", "reduce_scatter")]) == 1, (sp, fwd)
        bias = g.ops["layers.0.mlp.linear_fc2.bias"]
        assert tp_layouts(bias.in_layouts) == [P] and bias.partial_grad == ["bias"]  # added on one rank
    _, g = compiled("gpt.yaml", tp=2, sp=True)  # no partial sums to merge: Megatron's bias after the reduction
    assert tp_layouts(g.ops["layers.0.mlp.linear_fc2.bias"].in_layouts) == [SS]
