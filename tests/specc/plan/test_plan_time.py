"""Planning is linear in the layer count (issue 10: `specc plan` time grew with its square).

Counted, not timed, so a slow or busy machine never fails it: the Python and builtin function
calls (cProfile) that compile + plan + emit make for N, 2N and 4N layers. A linear pipeline costs
a + bN calls, so going from 2N to 4N layers adds exactly twice what going from N to 2N added; a
term in N^2 (a scan of all ops per op, of all repeated scopes per entry) adds four times as much.
The spec nests a repeated module inside each layer, so there are as many repeated scopes as
layers: a per-scope pass over all entries is quadratic there."""

from __future__ import annotations

import cProfile
import os
import pstats

from specc.compiler import load_and_compile
from specc.emit.emitter import emit_model
from specc.errors import Loc
from specc.frontend.model import Settings
from specc.plan import build_plan, plan_json, plan_text

GPT_TINY = os.path.join(os.path.dirname(__file__), "..", "..", "..", "specs", "gpt-tiny.yaml")

NESTED = """name: nested
extends: {spec}
modules:
  TransformerLayer:
    inputs: [x]
    submodules:
      input_layernorm: {{op: layernorm, hidden_size: "${{hidden_size}}"}}
      self_attention: {{module: SelfAttention}}
      pre_mlp_layernorm: {{op: layernorm, hidden_size: "${{hidden_size}}"}}
      mlps: {{module: MLP, repeat: 2}}
    forward:
      - x = x + self_attention(input_layernorm(x))
      - x = x + mlps(pre_mlp_layernorm(x))
      - return x
"""


def calls(spec: str, layers: int) -> int:
    profile = cProfile.Profile()
    profile.enable()
    _, graph = load_and_compile(spec, Settings(tp=2, sp=True), [("num_layers", layers, Loc("--set"))])
    plan = build_plan(graph)
    plan_text(plan)
    plan_json(plan)
    emit_model(graph, "specc compile")
    profile.disable()
    return sum(stat[1] for stat in pstats.Stats(profile).stats.values())  # total calls, recursive ones too


def test_planning_cost_is_linear_in_layers(tmp_path):
    spec = tmp_path / "nested.yaml"
    spec.write_text(NESTED.format(spec=os.path.abspath(GPT_TINY)))
    n = 16
    calls(str(spec), 2)  # first use: templates compiled, regexes cached, modules imported
    c1, c2, c4 = (calls(str(spec), k * n) for k in (1, 2, 4))
    first, second = c2 - c1, c4 - c2
    assert first > 0
    # linear: second == 2 * first (up to set-order noise); with a quadratic term, 2.5x and more here
    assert second <= 2.2 * first, f"calls at {n}, {2 * n}, {4 * n} layers: {c1}, {c2}, {c4} (+{first}, then +{second})"


def test_nested_repeats_fold_once(tmp_path):
    spec = tmp_path / "nested.yaml"
    spec.write_text(NESTED.format(spec=os.path.abspath(GPT_TINY)))
    _, graph = load_and_compile(str(spec), Settings(tp=2, sp=True), [("num_layers", 3, Loc("--set"))])
    plan = build_plan(graph)
    names = [e.name for e in plan.entries]
    assert len(names) == len(set(names))
    assert not [n for n in names if n.startswith("layers.") and not n.startswith("layers.*")]
    fc1 = next(e for e in plan.entries if e.name == "layers.*.mlps.*.linear_fc1")
    assert fc1.count == 6  # 3 layers x 2 MLPs
    assert plan.groups == {"layers.*": 3, "layers.*.mlps.*": 2}
    assert sum(e.count for e in plan.entries if e.kind == "linear") == sum(
        1 for op in graph.iter_ops() if op.kind == "linear")
