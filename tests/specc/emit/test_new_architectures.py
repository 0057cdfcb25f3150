"""Issue 10: architectures off the shipped path compile to modules that run, and at TP=2 (with
and without sequence parallelism, on 2 gloo ranks) match TP=1 in loss, every gradient and the
initial weights.

- a boundary read only by another boundary (a word embedding read only by a column-parallel
  linear: P -> I, then I -> R absorbed by the GEMM);
- a value gathered to full width before an op over the full width (a norm over the fused q/k/v
  width): the gather must put the fused segments back in order, and attention must be sized for
  what it receives;
- a `parallel: none` linear at TP=2: its weight is recorded as replicated (not as "split over one
  rank"), so TP-invariant init and gathering work, and its gradient is tp-partial where its
  input is sequence-parallel.

Tolerances: fp32 (unit roundoff u = 2^-24 = 6e-8). TP changes only the order of summation: of
dot products of length <= 48 and of the two ranks' partial sums, a few ops deep, so each value
differs from TP=1 by well under 1e-5 of the magnitude it is computed at. Gradients are compared
against the largest gradient of the model (a gradient that is zero in exact arithmetic is
rounding noise of that scale); weights at init must be bit-identical (drawn from the seed)."""

from __future__ import annotations

import os
import sys

import pytest

torch = pytest.importorskip("torch")

HERE = os.path.dirname(os.path.abspath(__file__))
if HERE not in sys.path:  # tp_equivalence, here and in the spawned ranks
    sys.path.insert(0, HERE)

import tp_equivalence  # noqa: E402

from specc.layouts import SH, I  # noqa: E402
from specc.ops import OPS  # noqa: E402

V, H, S, B = 32, 16, 8, 2
REL = 1e-5

HEADER = f"""name: NAME
model:
  module: M
  inputs:
    tokens: {{shape: [{B}, {S}], dtype: int64}}
    labels: {{shape: [{B}, {S}], dtype: int64}}
modules:
  M:
    inputs: [tokens, labels]
    submodules:
      emb: {{op: embedding, num_embeddings: {V}, embedding_dim: {H}}}
      head: {{op: linear, parallel: column, in_features: {H}, out_features: {V}, bias: false}}
      loss: {{op: cross_entropy}}
"""

SPECS = {
    # the embedding's partial sums are reduced (P -> I) and copied to R for the head (I -> R):
    # a boundary whose only consumer is another boundary
    "embedding_into_column": ("", ["logits = head(emb(tokens))"]),
    # LayerNorm over the whole fused [q | k | v] width, then attention
    "norm_over_fused_qkv": (
        f"""      qkv: {{op: linear, parallel: column, in_features: {H}, out_features: {3 * H}, segments: [{H}, {H}, {H}]}}
      qkv_norm: {{op: layernorm, hidden_size: {3 * H}}}
      split3: {{op: split, sections: [{H}, {H}, {H}]}}
      attn: {{op: core_attention, num_heads: 4, head_dim: 4}}
      proj: {{op: linear, parallel: row, in_features: {H}, out_features: {H}}}
""",
        ["h = emb(tokens)", "q, k, v = split3(qkv_norm(qkv(h)))", "h = h + proj(attn(q, k, v))",
         "logits = head(h)"]),
    # a replicated linear on the residual stream
    "replicated_linear": (
        f"""      norm: {{op: layernorm, hidden_size: {H}}}
      mix: {{op: linear, in_features: {H}, out_features: {H}}}
""",
        ["h = emb(tokens)", "h = h + mix(norm(h))", "logits = head(h)"]),
    # two column GEMMs whose S(h) shards are cut differently ([a | b] per segment vs one slab)
    # meet in an add that a row-parallel GEMM reads: their shards do not line up, so the add
    # must not run on S(h)
    "segmented_plus_slab": (
        f"""      up_fused: {{op: linear, parallel: column, in_features: {H}, out_features: {2 * H}, segments: [{H}, {H}]}}
      up_slab: {{op: linear, parallel: column, in_features: {H}, out_features: {2 * H}}}
      act: {{op: gelu}}
      down: {{op: linear, parallel: row, in_features: {2 * H}, out_features: {H}}}
""",
        ["h = emb(tokens)", "u = act(up_fused(h) + up_slab(h))", "h = h + down(u)", "logits = head(h)"]),
    # a fused [gate | up] GEMM (S(h), cut by segment) plus a replicated GEMM's full output, into
    # a SwiGLU: the replicated value is scattered to S(h) cut the same way, segment by segment
    "segmented_plus_replicated": (
        f"""      up_fused: {{op: linear, parallel: column, in_features: {H}, out_features: {4 * H}, segments: [{2 * H}, {2 * H}]}}
      wide: {{op: linear, in_features: {H}, out_features: {4 * H}}}
      glu: {{op: swiglu}}
      down: {{op: linear, parallel: row, in_features: {2 * H}, out_features: {H}}}
""",
        ["h = emb(tokens)", "h = h + down(glu(up_fused(h) + wide(h)))", "logits = head(h)"]),
}


def spec_text(name: str) -> str:
    extra, steps = SPECS[name]
    steps = steps + ["l = loss(logits, labels)", "return l"]
    return HEADER.replace("NAME", name) + extra + "    forward:\n" + "".join(f"      - {s}\n" for s in steps)


@pytest.fixture
def spec_file(tmp_path):
    def write(name: str) -> str:
        path = tmp_path / f"{name}.yaml"
        path.write_text(spec_text(name))
        return str(path)
    return write


def _compile(path, tp, sp):
    from specc.settings import Settings
    from specc_torch.api import compile_source

    return compile_source(path, Settings(tp=tp, sp=sp, dtype="fp32"))


def _assert_matches(name, got, ref):
    scale = max(r.abs().max().item() for r in ref["grads"].values())
    assert got["loss"].shape == ref["loss"].shape
    diff = (got["loss"] - ref["loss"]).abs().max().item()
    assert diff <= REL * ref["loss"].abs().max().item(), f"{name}: loss differs by {diff:.3e}"
    assert sorted(got["grads"]) == sorted(ref["grads"])
    for param, r in ref["grads"].items():
        g = got["grads"][param]
        assert g.shape == r.shape, param
        diff = (g - r).abs().max().item()
        assert diff <= REL * scale, f"{name}: gradient of {param} differs by {diff:.3e} (scale {scale:.3e})"
        assert torch.equal(got["weights"][param], ref["weights"][param]), f"{name}: init of {param} differs"


@pytest.mark.parametrize("name", sorted(SPECS))
def test_tp2_matches_tp1(gloo, spec_file, name):
    path = spec_file(name)
    ref = tp_equivalence.step(0, 1, path, False, V, B, S)
    for sp in (False, True):
        got = gloo.run(2, tp_equivalence.step, path, sp, V, B, S)
        for rank in got:
            _assert_matches(f"{name} tp=2 sp={sp}", rank, ref)
        assert got[0]["replicated"] == ref["replicated"]


def test_boundary_read_only_by_a_boundary_compiles(spec_file):
    path = spec_file("embedding_into_column")
    for sp in (False, True):
        _, _, graph = _compile(path, 2, sp)
        head = graph.ops["head"]
        # the reduction of the embedding's partial sums stays; the next conversion (to R) is
        # absorbed by the GEMM
        convs = [op for op in graph.iter_ops() if OPS[op.kind].converts()]
        assert [op.attrs["src"] for op in convs] == ["P"]
        assert len(head.absorbed) == 1 and head.absorbed[0].boundary.src == convs[0].attrs["dst"]
        assert head.inputs == convs[0].outputs


def test_gather_of_fused_segments_keeps_their_order(spec_file):
    source, _, graph = _compile(spec_file("norm_over_fused_qkv"), 2, False)
    gathers = [op for op in graph.iter_ops() if OPS[op.kind].converts() and op.attrs["src"] == SH]
    assert [op.attrs.get("segments") for op in gathers] == [(H, H, H)]
    assert f"segments=[{H}, {H}, {H}]" in source
    attn = graph.ops["attn"]
    assert attn.in_layouts[0]["tp"] == I  # it gets whole q, k, v: all 4 heads on every rank
    assert "runtime.CoreAttention(4, 4, 4," in source


def test_replicated_linear_is_recorded_replicated(spec_file):
    path = spec_file("replicated_linear")
    source, _, graph = _compile(path, 2, True)
    assert "replicated=True" in source
    assert graph.ops["mix"].partial_grad == ["weight", "bias"]  # S(s) input: a piece of the grad per rank
    _, _, graph = _compile(path, 2, False)
    assert graph.ops["mix"].partial_grad == []


def test_shards_cut_differently_are_not_joined_on_sh(spec_file):
    _, _, graph = _compile(spec_file("segmented_plus_slab"), 2, False)
    add = next(op for op in graph.iter_ops() if op.kind == "add")
    assert [graph.values[v].producer for v in add.inputs] != ["up_fused", "up_slab"]
    assert [lay["tp"] for lay in add.in_layouts] == [I, I]  # both gathered (by segment), then added
    gathers = [op for op in graph.iter_ops() if OPS[op.kind].converts() and op.attrs["src"] == SH]
    assert [op.attrs.get("segments") for op in gathers] == [(2 * H // 2, 2 * H // 2), None]
    # the row-parallel GEMM reads one slab: the scatter before it cuts one
    scatter = graph.ops[graph.ops["down"].inputs[0]]
    assert OPS[scatter.kind].converts() and scatter.attrs["dst"] == SH and "segments" not in scatter.attrs


def test_scatter_cuts_as_its_consumer_needs(spec_file):
    source, _, graph = _compile(spec_file("segmented_plus_replicated"), 2, False)
    add = next(op for op in graph.iter_ops() if op.kind == "add")
    assert [lay["tp"] for lay in add.in_layouts] == [SH, SH]
    scatter = graph.ops[graph.values[add.inputs[1]].producer]
    assert OPS[scatter.kind].converts() and scatter.attrs["dst"] == SH
    assert scatter.attrs["segments"] == (2 * H, 2 * H) and f"segments=[{2 * H}, {2 * H}]" in source
    assert graph.ops["glu"].in_layouts[0]["tp"] == SH


def test_slab_reader_of_a_segmented_shard_is_a_located_error(tmp_path):
    from specc.errors import SpecError

    path = tmp_path / "slab.yaml"
    path.write_text(HEADER.replace("NAME", "slab") + f"""      up: {{op: linear, parallel: column, in_features: {H}, out_features: {2 * H}, segments: [{H}, {H}]}}
      act: {{op: gelu}}
      down: {{op: linear, parallel: row, in_features: {2 * H}, out_features: {H}}}
    forward:
      - h = emb(tokens)
      - h = h + down(act(up(h)))
      - logits = head(h)
      - l = loss(logits, labels)
      - return l
""")
    with pytest.raises(SpecError) as e:
        _compile(str(path), 2, False)
    assert "down: linear reads" in e.value.what and "as one slab" in e.value.what
    assert "cut by segments [16, 16]" in e.value.what and "drop segments" in e.value.hint
    assert e.value.loc.path == str(path) and e.value.loc.line == 19
    _compile(str(path), 1, False)  # one rank holds everything: fine
