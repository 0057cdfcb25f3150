"""A repeated submodule whose layers are different modules, picked by a pattern (Megatron's hybrid
override pattern, Nemotron-H's layers): the layers built, the summary and the plan counting each
kind, the Mamba-2 mixer's FLOPs and memory in the plan, and the pattern's located errors."""

from __future__ import annotations

import pytest

from specc.compiler import load_and_compile
from specc.frontend.model import Settings
from specc.plan.build import build_plan
from specc.summary import summarize

from .conftest import ROOT

HYBRID = """\
    name: hybrid
    config: {hidden_size: 32, pattern: "A-AB"}
    model:
      module: Model
      inputs:
        x: {shape: [micro_batch_size, 8, 32], dtype: float32}
    modules:
      Model:
        inputs: [x]
        submodules:
          layers: {modules: {A: Wide, B: Narrow, "-": Narrow}, pattern: "${pattern}"}
        forward:
          - h = layers(x)
          - return h
      Wide:
        inputs: [x]
        submodules:
          fc: {op: linear, in_features: 32, out_features: 32}
        forward:
          - y = x + fc(x)
          - return y
      Narrow:
        inputs: [x]
        submodules:
          act: {op: gelu}
        forward:
          - y = act(x)
          - return y
    """


def test_each_layer_is_the_module_its_pattern_entry_names(write):
    spec, graph = load_and_compile(write(HYBRID))
    assert [graph.scopes[f"layers.{i}"] for i in range(4)] == ["Wide", "Narrow", "Wide", "Narrow"]
    assert summarize(graph).startswith("hybrid: 4 layers (2 Wide, 2 Narrow)")
    # a list of keys works as a string of characters does (Hugging Face's layers_block_type)
    spec, graph = load_and_compile(write(HYBRID.replace('"${pattern}"', "[A, B, B]")))
    assert [graph.scopes[f"layers.{i}"] for i in range(3)] == ["Wide", "Narrow", "Narrow"]


@pytest.mark.parametrize("old, new, where, message", [
    ('pattern: "${pattern}"', 'pattern: "AXA"', "11:69", "pattern entry 'X' (layer 1) is not a key of 'modules'"),
    ('pattern: "${pattern}"', 'pattern: "${pattern}", repeat: 3', "11:91", "repeat=3, but 'pattern' names 4 layers"),
    (', pattern: "${pattern}"', "", "11:16", "submodule 'layers' has 'modules' without 'pattern'"),
    ("B: Narrow", "B: Narow", "11:38", "undefined module 'Narow'"),
    ("pattern: \"${pattern}\"", "pattern: 3", "11:69", "'pattern' must be a string (one character a layer) or a list"),
])
def test_pattern_errors_are_located(error, old, new, where, message):
    e = error(HYBRID.replace(old, new))
    assert f"spec.yaml:{where}: error: {message}" in str(e), str(e)


def test_nemotron_h_counts_each_layer_kind_and_plans_the_mixer():
    """Nemotron-H-8B: 8,100,852,736 parameters (the published checkpoint's tensors), 24 Mamba-2,
    4 attention and 24 MLP layers, each kind folded in the plan; the mixer's plan line at TP 8
    with SP: its S(h) shard in and out, no collective of its own, the SSD scan's FLOPs
    (specc/ops/mamba.py) and only its input kept for backward."""
    s, b, t = 8192, 1, 8
    _, graph = load_and_compile(f"{ROOT}/specs/nemotron-h.yaml", Settings(tp=t, sp=True, micro_batch_size=b), plan_only=True)
    assert summarize(graph).startswith("nemotron_h: 52 layers (24 MambaLayer, 24 MLPLayer, 4 AttentionLayer), "
                                       "hidden 4096, 32 heads, 8,100,852,736 parameters")
    plan = build_plan(graph)
    assert plan.groups == {"layers.{MambaLayer}": 24, "layers.{MLPLayer}": 24, "layers.{AttentionLayer}": 4}
    ssm = next(e for e in plan.entries if e.name == "layers.{MambaLayer}.mixer.ssm")
    h, p, n, q = 128 // t, 64, 128, 128
    forward = 2 * b * s * h * (q * n + q * p + 2 * n * p) + 2 * b * h * (s // q + 1) ** 2 * p * n
    width = (2 * 8192 + 2 * 8 * 128 + 128) // t  # this rank's [z | x | B | C | dt]
    assert (ssm.count, ssm.layouts_in, ssm.layouts_out, ssm.forward, ssm.backward) == (24, ["S(h)"], ["S(h)"], [], [])
    assert ssm.flops == (forward, 2 * forward) and ssm.saved == s * b * width * 2
