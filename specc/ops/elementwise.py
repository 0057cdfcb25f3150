"""Elementwise and shape ops: they keep whatever layout their inputs share."""

from __future__ import annotations

from ..errors import SpecError
from .base import Attr, LayoutRule, OpKind, numel

_NOT_P = ("I", "R", "S(s)", "S(h)")


def _same_shapes(shapes, fail):
    for s in shapes[1:]:
        if s != shapes[0]:
            fail(f"operands have different shapes {list(shapes[0])} and {list(s)}")
    return [shapes[0]]


class Add(OpKind):
    name = "add"
    doc = "Sum of two or more values (written `a + b` in a forward step)."
    n_inputs = (2, 64)
    builtin = True
    any_cut = True

    def out_shapes(self, attrs, shapes, fail):
        return _same_shapes(shapes, fail)

    def rule_tp(self, attrs, ctx):
        return LayoutRule(allowed=_NOT_P, accepts_reduction=True, partial_ok=True)

    def out_segments(self, attrs, in_segments):
        return in_segments[0] if in_segments else ()  # elementwise: the inputs' common cut

    def call(self, node, args, ctx):
        return " + ".join(args)


class Mul(OpKind):
    name = "mul"
    doc = "Elementwise product (written `a * b`); a product of partial sums is not a partial sum."
    n_inputs = (2, 2)
    builtin = True
    nonlinear = True
    any_cut = True

    def out_shapes(self, attrs, shapes, fail):
        return _same_shapes(shapes, fail)

    def saved_bytes(self, node, local_in, local_out, elt):
        return [(v, numel(s) * elt) for v, s in zip(node.inputs, local_in)]

    def out_segments(self, attrs, in_segments):
        return in_segments[0] if in_segments else ()  # elementwise: the inputs' common cut

    def call(self, node, args, ctx):
        return f"{args[0]} * {args[1]}"


class _Activation(OpKind):
    nonlinear = True
    any_cut = True
    function = ""

    def out_segments(self, attrs, in_segments):
        return in_segments[0] if in_segments else ()

    def saved_bytes(self, node, local_in, local_out, elt):
        return [(node.inputs[0], numel(local_in[0]) * elt)]

    def call(self, node, args, ctx):
        return f"{self.function}({args[0]})"


class Gelu(_Activation):
    name = "gelu"
    doc = "GELU (exact, erf form)."
    function = "runtime.gelu"


class Silu(_Activation):
    name = "silu"
    doc = "SiLU / swish."
    function = "torch.nn.functional.silu"


class Swiglu(_Activation):
    name = "swiglu"
    doc = "silu(gate) * up over a last dim laid out [gate | up]; halves the last dim."
    function = "runtime.swiglu"
    needs_segments = 2

    def out_shapes(self, attrs, shapes, fail):
        x = shapes[0]
        if x[-1] % 2:
            fail(f"last dim {x[-1]} is odd; swiglu splits it into equal [gate | up] halves")
        return [tuple(x[:-1]) + (x[-1] // 2,)]

    def input_segments(self, attrs, shapes):
        half = shapes[0][-1] // 2
        return (half, half)

    def out_segments(self, attrs, in_segments):
        return ()


class Dropout(OpKind):
    name = "dropout"
    doc = "Dropout; in sharded regions each rank draws its own mask (Megatron's RNG tracker)."
    attrs = (Attr("p", "float", default=0.0, minimum=0.0),)
    any_cut = True

    def check(self, attrs, locs, ctx):
        if attrs["p"] >= 1.0:
            raise SpecError(locs.get("p"), f"dropout p={attrs['p']} must be below 1")

    def rule_tp(self, attrs, ctx):
        return LayoutRule(allowed=_NOT_P, accepts_reduction=True)

    def out_segments(self, attrs, in_segments):
        return in_segments[0] if in_segments else ()

    def saved_bytes(self, node, local_in, local_out, elt):
        return [(node.id + ":mask", numel(local_in[0]))] if node.attrs["p"] > 0 else []

    def constructor(self, node, ctx):
        layout = node.in_layouts[0]["tp"]
        stream = "default" if layout in ("I", "R") else "tensor-parallel"
        where = f', layout="{layout}", tp=self.tp' if layout in ("S(s)", "S(h)") and ctx.tp > 1 else ""
        return f'runtime.Dropout({node.attrs["p"]!r}, rng_tracker=rng_tracker, stream="{stream}"{where})'

    def call(self, node, args, ctx):
        return f"self.{node.attr_name}({args[0]})"


class Split(OpKind):
    name = "split"
    doc = "Split the last dim into sections (e.g. a fused QKV output into q, k, v)."
    attrs = (Attr("sections", "int_list", required=True),)
    nonlinear = True  # keeps reductions out of the middle of attention
    any_cut = True  # with one section it is the identity; with more it declares its cut

    def out_count(self, attrs):
        return len(attrs["sections"])

    def out_shapes(self, attrs, shapes, fail):
        x = shapes[0]
        if sum(attrs["sections"]) != x[-1]:
            fail(f"sections {list(attrs['sections'])} sum to {sum(attrs['sections'])}, but the input's last dim is {x[-1]}")
        return [tuple(x[:-1]) + (n,) for n in attrs["sections"]]

    def input_segments(self, attrs, shapes):
        return tuple(attrs["sections"]) if len(attrs["sections"]) > 1 else ()

    def call(self, node, args, ctx):
        t = ctx.tp if node.in_layouts[0]["tp"] == "S(h)" else 1
        return f"runtime.split({args[0]}, {[n // t for n in node.attrs['sections']]})"
