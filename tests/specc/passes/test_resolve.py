"""Backend resolution: auto picks TransformerEngine where the target has it, never silently falls
back when te is asked for, and says why each choice was made."""

from __future__ import annotations

import os

import pytest

from specc.compiler import compile_graph, load_and_compile
from specc.emit import emit_model
from specc.errors import SpecError
from specc.frontend.load import load_spec
from specc.frontend.model import Settings
from specc.plan import build_plan, plan_json, plan_text

SPECS = os.path.join(os.path.dirname(__file__), "..", "..", "..", "specs")


def compile_with(name, have, **settings):
    return compile_graph(load_spec(os.path.join(SPECS, name), Settings(**settings)), have=have)


def test_auto_without_te_is_native_and_says_why():
    g = compile_with("gpt-tiny.yaml", have=lambda b: False, tp=2)
    qkv = g.ops["layers.0.self_attention.linear_qkv"]
    assert qkv.impl == "native" and qkv.impl_reason == "auto: transformer_engine not installed"
    attn = g.ops["layers.0.self_attention.core_attention"]
    assert attn.impl == "native" and "flash_attn" in attn.impl_reason
    assert g.ops["layers.0.mlp.activation"].impl_reason == "auto: only a native implementation"


def test_auto_with_te_uses_it_where_it_exists():
    g = compile_with("gpt-tiny.yaml", have=lambda b: b == "te", tp=2, sp=True)
    assert g.ops["layers.0.self_attention.linear_qkv"].impl == "te"
    assert g.ops["layers.0.input_layernorm"].impl == "te"
    assert g.ops["layers.0.self_attention.core_attention"].impl == "te"
    assert g.ops["layers.0.mlp.activation"].impl == "native"
    out = g.ops["output_layer"]  # tied to the embedding: stays native, with the reason
    assert out.impl == "native" and "tied weight" in out.impl_reason
    code = emit_model(g, "x")
    assert 'runtime.TEColumnParallelLinear(CONFIG["hidden_size"], 3 * CONFIG["hidden_size"]' in code
    assert "runtime.TELayerNorm(64" in code
    assert 'backend="te"' in code
    assert 'runtime.ColumnParallelLinear(CONFIG["hidden_size"], CONFIG["vocab_size"], bias=False' in code  # tied
    assert '"impl": "te"' in plan_json(build_plan(g))


def test_flash_for_attention_when_only_flash_is_there():
    g = compile_with("llama-tiny.yaml", have=lambda b: b == "flash", tp=2)
    assert g.ops["layers.0.self_attention.core_attention"].impl == "flash"
    assert 'backend="flash"' in emit_model(g, "x")


def test_asking_for_te_where_it_is_missing_is_an_error():
    with pytest.raises(SpecError) as e:
        compile_with("gpt-tiny.yaml", have=lambda b: False, tp=2, backend="te")
    assert "transformer_engine is not installed" in e.value.what and "specc[te]" in e.value.hint
    assert str(e.value.loc) == "--backend"


def test_planning_te_needs_no_transformer_engine():
    """A CPU box plans the production layout: validate, plan, graph and diff take --backend te
    without the package (the reason says it is planned only); compile, verify and train still
    refuse, since what they emit imports it; `auto` still means what this machine has."""
    missing = lambda b: False  # noqa: E731
    spec = os.path.join(SPECS, "gpt-tiny.yaml")
    _, g = load_and_compile(spec, Settings(tp=2, backend="te"), have=missing, plan_only=True)
    norm = g.ops["layers.0.input_layernorm"]
    assert (norm.impl, norm.impl_reason) == ("te", "--backend: te (planned only: transformer_engine is not installed here)")
    assert " te " in plan_text(build_plan(g))
    with pytest.raises(SpecError, match="transformer_engine is not installed"):
        load_and_compile(spec, Settings(tp=2, backend="te"), have=missing)
    _, g = load_and_compile(spec, Settings(tp=2), have=missing, plan_only=True)
    assert g.ops["layers.0.input_layernorm"].impl == "native"


def test_pinning_te_on_a_tied_layer_is_an_error(tmp_path):
    spec = tmp_path / "pin.yaml"
    spec.write_text(f"name: pin\nextends: {os.path.join(SPECS, 'gpt-tiny.yaml')}\n"
                    "modules:\n  GPTModel:\n    submodules:\n      output_layer: {impl: te}\n")
    with pytest.raises(SpecError) as e:
        compile_graph(load_spec(str(spec), Settings(tp=2)), have=lambda b: True)
    assert "tied weight cannot use impl 'te'" in e.value.what
    assert e.value.loc.path == str(spec) and e.value.loc.line == 6


def test_te_classes_fail_clearly_without_transformer_engine():
    torch = pytest.importorskip("torch")  # noqa: F841
    import importlib.util

    import runtime

    if importlib.util.find_spec("transformer_engine") is not None:
        pytest.skip("TransformerEngine is installed here")
    with pytest.raises(ImportError, match="recompile with --backend native"):
        runtime.TEColumnParallelLinear(8, 8, tp=runtime.Group.single("tp"))
    with pytest.raises(ImportError, match="TransformerEngine"):
        runtime.TERMSNorm(8)


def test_norms_te_cannot_compute_fall_back_or_are_refused(tmp_path):
    """TransformerEngine's norms span the whole last dim with a bias: a per-head norm (Qwen3's
    q/k) asked for only by auto gets native with the reason; pinned to te it is a located error;
    OLMo 2's full-width q/k norms on TP shards are pinned native in its spec."""
    g = compile_with("qwen3-tiny.yaml", have=lambda b: b == "te", tp=2)
    q_norm = g.ops["layers.0.self_attention.q_norm"]
    assert q_norm.impl == "native" and q_norm.impl_reason == (
        "te cannot normalize per head (TransformerEngine's norms span the whole last dim)")
    assert g.ops["layers.0.input_norm"].impl == "te"
    pinned = tmp_path / "pinned.yaml"
    pinned.write_text(f"name: pinned\nextends: {os.path.abspath(os.path.join(SPECS, 'qwen3-tiny.yaml'))}\n"
                      "modules: {SelfAttention: {submodules: {k_norm: {impl: te}}}}\n", encoding="utf-8")
    with pytest.raises(SpecError) as e:
        compile_graph(load_spec(str(pinned), Settings(tp=2)), have=lambda b: True)
    assert str(e.value).startswith(f"{pinned}:3:") and "k_norm: impl 'te' cannot normalize per head" in str(e.value)
    olmo = compile_with("olmo2-tiny.yaml", have=lambda b: b == "te", tp=2, sp=True)
    assert olmo.ops["layers.0.self_attention.q_norm"].impl == "native"
    assert "runtime.RMSNorm(64, eps=1e-06, tp=self.tp)" in emit_model(olmo, "specc compile")


def test_attention_kernels_without_windows_or_caps_fall_back_or_are_refused(tmp_path):
    """flash-attn and TE attention are wired for the plain mask only: Gemma 2's windowed,
    soft-capped, rescaled attention gets native from auto with the reason (it would fail to build
    on a machine that has them), and pinned to flash it is a located error."""
    g = compile_with("gemma2-tiny.yaml", have=lambda b: True, tp=2)
    attn = g.ops["layers.1.self_attention.core_attention"]  # a full-attention layer: still scaled and capped
    assert attn.impl == "native" and attn.impl_reason == (
        "te is not wired for window_pattern, scale, softcap (the native path computes them)")
    assert g.ops["layers.0.self_attention.linear_qkv"].impl == "te"
    assert compile_with("llama-tiny.yaml", have=lambda b: True, tp=2).ops[
        "layers.0.self_attention.core_attention"].impl == "te"
    pinned = tmp_path / "pinned.yaml"
    pinned.write_text(f"name: pinned\nextends: {os.path.abspath(os.path.join(SPECS, 'mistral-tiny.yaml'))}\n"
                      "modules: {SelfAttention: {submodules: {core_attention: {impl: flash}}}}\n", encoding="utf-8")
    with pytest.raises(SpecError) as e:
        compile_graph(load_spec(str(pinned), Settings(tp=2)), have=lambda b: True)
    assert str(e.value).startswith(f"{pinned}:3:") and "core_attention: impl 'flash' is not wired for window" in str(e.value)
