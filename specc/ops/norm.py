"""Normalization over the last dim. In a sequence-parallel region each rank normalizes its own
rows, so the weights see rank-divergent inputs and their gradients are partial over TP."""

from __future__ import annotations

from .base import Attr, LayoutRule, OpKind, Weight, numel


class _Norm(OpKind):
    attrs = (
        Attr("hidden_size", "int", required=True, minimum=1),
        Attr("eps", "float", default=1e-5, minimum=0.0),
    )
    impls = ("native", "te")
    runtime_class = ""

    def out_shapes(self, attrs, shapes, fail):
        if shapes[0][-1] != attrs["hidden_size"]:
            fail(f"input has last dim {shapes[0][-1]}, expected hidden_size={attrs['hidden_size']}")
        return [shapes[0]]

    def rule_tp(self, attrs, ctx):
        return LayoutRule(allowed=("I", "R", "S(s)"), accepts_reduction=True)

    def saved_bytes(self, node, local_in, local_out, elt):
        return [(node.inputs[0], numel(local_in[0]) * elt)]

    def constructor(self, node, ctx):
        te = "TE" if node.impl == "te" else ""
        return f"runtime.{te}{self.runtime_class}({node.attrs['hidden_size']}, eps={node.attrs['eps']!r})"

    def call(self, node, args, ctx):
        return f"self.{node.attr_name}({args[0]})"


class LayerNorm(_Norm):
    name = "layernorm"
    doc = "LayerNorm with weight and bias."
    runtime_class = "LayerNorm"

    def weights(self, attrs):
        h = attrs["hidden_size"]
        return [Weight("weight", (h,), "ones"), Weight("bias", (h,), "zeros")]


class RMSNorm(_Norm):
    name = "rmsnorm"
    doc = "RMSNorm (no bias, no mean subtraction)."
    runtime_class = "RMSNorm"

    def weights(self, attrs):
        return [Weight("weight", (attrs["hidden_size"],), "ones")]
