"""Property test: random valid op graphs, compiled at TP 2 and 4 with and without sequence
parallelism, type-check — every consumer receives the layout it requires — and carry no
redundant boundary."""

from __future__ import annotations

import re

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from specc.compiler import load_and_compile
from specc.errors import SpecError
from specc.frontend.model import Settings
from specc.layouts import P, conversion_path
from specc.ops import OPS, Ctx

H, F, V, S = 16, 32, 32, 8
BLOCKS = ("mlp", "gated_mlp", "attention", "norm", "replicated", "dropout", "parallel")


def submodules() -> str:
    return f"""
      emb: {{op: embedding, num_embeddings: {V}, embedding_dim: {H}}}
      norm: {{op: layernorm, hidden_size: {H}}}
      rms: {{op: rmsnorm, hidden_size: {H}}}
      up: {{op: linear, parallel: column, in_features: {H}, out_features: {F}}}
      gate_up: {{op: linear, parallel: column, in_features: {H}, out_features: {2 * F}, segments: [{F}, {F}], bias: false}}
      down: {{op: linear, parallel: row, in_features: {F}, out_features: {H}, bias: false}}
      down_b: {{op: linear, parallel: row, in_features: {F}, out_features: {H}}}
      act: {{op: gelu}}
      glu: {{op: swiglu}}
      qkv: {{op: linear, parallel: column, in_features: {H}, out_features: {3 * H}, segments: [{H}, {H}, {H}]}}
      split3: {{op: split, sections: [{H}, {H}, {H}]}}
      rot: {{op: rotary, head_dim: 4}}
      attn: {{op: core_attention, num_heads: 4, head_dim: 4}}
      proj: {{op: linear, parallel: row, in_features: {H}, out_features: {H}}}
      mix: {{op: linear, in_features: {H}, out_features: {H}}}
      drop: {{op: dropout, p: 0.1}}
      head: {{op: linear, parallel: column, in_features: {H}, out_features: {V}, bias: false}}
      loss: {{op: cross_entropy}}"""


def block(kind: str, x: str, n: int, earlier: list, draw) -> tuple:
    """Forward steps for one random block reading `x`; (steps, name of its result)."""
    y = f"v{n}"
    residual = draw(st.sampled_from(earlier))
    if kind == "mlp":
        mid = draw(st.sampled_from(["act(up(norm(x)))", "up(x)"])).replace("x", x)
        return [f"{y} = {residual} + down_b({mid})"], y
    if kind == "gated_mlp":
        return [f"{y} = {residual} + down(glu(gate_up(rms({x}))))"], y
    if kind == "attention":
        return [f"q{n}, k{n}, w{n} = split3(qkv(norm({x})))", f"q{n} = rot(q{n})", f"k{n} = rot(k{n})",
                f"{y} = {x} + proj(attn(q{n}, k{n}, w{n}))"], y
    if kind == "norm":
        return [f"{y} = {draw(st.sampled_from(['norm', 'rms']))}({x})"], y
    if kind == "replicated":
        return [f"{y} = mix({x}) + {residual}"], y
    if kind == "dropout":
        return [f"{y} = drop({x})"], y
    # a parallel block: two row-parallel branches whose partial sums meet
    return [f"n{n} = norm({x})", f"{y} = {x} + down(act(up(n{n}))) + down(glu(gate_up(n{n})))"], y


@st.composite
def random_spec(draw):
    steps, x, earlier = ["h = emb(tokens)"], "h", ["h"]
    for n in range(draw(st.integers(1, 5))):
        new, x = block(draw(st.sampled_from(BLOCKS)), x, n, earlier, draw)
        steps += new
        earlier.append(x)
    steps += [f"logits = head({draw(st.sampled_from(['norm', 'rms']))}({x}))", "l = loss(logits, labels)", "return l"]
    forward = "\n".join(f"      - {s}" for s in steps)
    used = "\n".join(line for line in submodules().splitlines()
                     if line.strip() and re.search(rf"\b{line.split(':')[0].strip()}\(", forward))
    return f"""name: random
model:
  module: M
  inputs:
    tokens: {{shape: [2, {S}], dtype: int64}}
    labels: {{shape: [2, {S}], dtype: int64}}
modules:
  M:
    inputs: [tokens, labels]
    submodules:
{used}
    forward:
{forward}
"""


def check_typed(graph) -> None:
    graph.lint()
    settings = graph.spec.settings
    for op in graph.iter_ops():
        kind = OPS[op.kind]
        got = [graph.values[v].layout for v in op.inputs]
        assert got == op.in_layouts, f"{op.id} receives {got} but requires {op.in_layouts}"
        if kind.converts():
            b = kind.boundary(op)
            assert b.src != b.dst
            src = graph.values[op.inputs[0]].producer
            if src and OPS[graph.ops[src].kind].converts():
                prev = OPS[graph.ops[src].kind].boundary(graph.ops[src])
                if prev.axis == b.axis:
                    assert not kind.undoes(op, graph.ops[src]), f"{op.id} undoes {src}"
                    assert conversion_path(b.axis, prev.src, b.dst) != [], f"{src} then {op.id} is a no-op"
            assert graph.consumers(op.outputs[0]), f"{op.id} converts a value nobody reads"
            continue
        for axis in graph.mesh.axes:
            ctx = Ctx.of(settings).on(axis)
            rule = kind.rule(op.attrs, ctx)
            for i, layout in enumerate(op.in_layouts):
                lay = layout[axis]
                fixed = rule.fixed_inputs[i] if rule.fixed_inputs else None
                if ctx.size == 1:
                    assert lay == "I"
                elif fixed is not None:
                    absorbed = [a.boundary for a in op.absorbed if i == 0 and a.boundary.axis == axis]
                    assert lay == fixed or (absorbed and absorbed[0].src == lay and absorbed[0].dst == fixed), op.id
                else:
                    assert lay in rule.allowed or (lay == P and rule.partial_ok), f"{op.id}: {lay} on {axis}"
    seen = set()
    for op in graph.iter_ops():  # one conversion of a value to a layout per module
        if OPS[op.kind].converts():
            b = OPS[op.kind].boundary(op)
            key = (op.inputs[0], b.axis, b.dst, op.scope)
            assert key not in seen, f"{op.id} repeats a conversion"
            seen.add(key)
    for vid in graph.outputs:
        assert str(graph.values[vid].layout) == "I"


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(text=random_spec(), tp=st.sampled_from([1, 2, 4]), cp=st.sampled_from([1, 2]), sp=st.booleans(),
       fuse=st.booleans())
def test_random_graphs_typecheck_without_redundant_boundaries(tmp_path_factory, text, tp, cp, sp, fuse):
    path = tmp_path_factory.mktemp("g") / "random.yaml"
    path.write_text(text)
    try:
        _, graph = load_and_compile(str(path), Settings(tp=tp, cp=cp, sp=sp, fuse=fuse, micro_batch_size=2), lint=True)
    except SpecError as e:  # the only allowed failure: a located, one-line error
        assert e.loc is not None and "\n" not in e.format()
        raise
    check_typed(graph)
