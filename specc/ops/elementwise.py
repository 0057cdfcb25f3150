"""Elementwise and shape ops: they keep whatever layout their inputs share."""

from __future__ import annotations

from ..errors import SpecError
from ..layouts import sh_local_size
from .activations import ACTIVATIONS, PLAIN
from .base import Attr, HFKnob, LayoutRule, OpKind, need_divisible, numel

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

    def memory_traffic(self, node, local_in, local_out, elt):
        """Forward reads the inputs and writes the sum. Backward runs no kernel of its own (torch's
        add hands the output's gradient to every input as it is); where an input also feeds
        another op (the residual stream, x in x + f(x)), autograd sums the two gradients: one
        pass reading two and writing one, counted here, as many bytes as the forward's."""
        forward = (sum(numel(s) for s in local_in) + sum(numel(s) for s in local_out)) * elt
        return forward, forward

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


APPROXIMATE = Attr("approximate", "str", default="none", choices=("none", "tanh"),
                   doc="none: the exact erf form; tanh: the tanh approximation (HF gelu_new, gelu_pytorch_tanh)")


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
    doc = "GELU: exact (erf), or the tanh approximation with approximate: tanh (GPT-2's gelu_new)."
    attrs = (APPROXIMATE,)
    function = ACTIVATIONS["gelu"].function

    def call(self, node, args, ctx):
        if node.attrs.get("approximate", "none") == "tanh":
            return f'runtime.gelu({args[0]}, approximate="tanh")'
        return f"runtime.gelu({args[0]})"


class Silu(_Activation):
    name = "silu"
    doc = "SiLU / swish."
    function = ACTIVATIONS["silu"].function


class Relu(_Activation):
    name = "relu"
    doc = "ReLU."
    function = ACTIVATIONS["relu"].function


class SquaredRelu(_Activation):
    name = "squared_relu"
    doc = "relu(x)^2 (Primer; Megatron's squared_relu)."
    function = ACTIVATIONS["squared_relu"].function


class Glu(_Activation):
    """A gated linear unit: act(gate) * up, from one fused [gate | up] value (a column-parallel
    gate+up linear with two segments, sharded segment by segment) or from two values (separate
    gate and up linears). Elementwise per feature, so any TP shard of its halves will do."""

    name = "gated_linear_unit"
    doc = ("act(gate) * up, from one [gate | up] value (halves its last dim) or from two values gate, up; "
           "activation: " + " | ".join(PLAIN) + ".")
    attrs = (Attr("activation", "str", required=True, choices=PLAIN,
                  doc="applied to the gate; gelu_tanh is GELU's tanh approximation (HF gelu_pytorch_tanh)"),)
    n_inputs = (1, 2)

    def activation(self, attrs) -> str:
        return attrs["activation"]

    def out_shapes(self, attrs, shapes, fail):
        if len(shapes) == 2:
            return _same_shapes(shapes, fail)
        x = shapes[0]
        if x[-1] % 2:
            fail(f"last dim {x[-1]} is odd; {self.name} splits it into equal [gate | up] halves")
        return [tuple(x[:-1]) + (x[-1] // 2,)]

    def input_segments(self, attrs, shapes):
        if len(shapes) == 2:
            return ()  # gate and up come apart: elementwise on both
        half = shapes[0][-1] // 2
        return (half, half)

    def out_segments(self, attrs, in_segments):
        return in_segments[0] if len(in_segments) == 2 else ()

    def saved_bytes(self, node, local_in, local_out, elt):
        return [(v, numel(s) * elt) for v, s in zip(node.inputs, local_in)]

    def call(self, node, args, ctx):
        return f'runtime.glu({", ".join(args)}, activation="{self.activation(node.attrs)}")'


class Swiglu(Glu):
    name = "swiglu"
    doc = "silu(gate) * up over a last dim laid out [gate | up] (halves it), or of two values gate, up."
    attrs = ()

    def activation(self, attrs):
        return "silu"

    def call(self, node, args, ctx):
        if len(args) == 1:
            return f"runtime.swiglu({args[0]})"
        return super().call(node, args, ctx)


class Geglu(Glu):
    name = "geglu"
    doc = "gelu(gate) * up (approximate: tanh for Gemma's gelu_pytorch_tanh), of [gate | up] or of gate, up."
    attrs = (APPROXIMATE,)

    def activation(self, attrs):
        return "gelu_tanh" if attrs.get("approximate", "none") == "tanh" else "gelu"


class Reglu(Glu):
    name = "reglu"
    doc = "relu(gate) * up, of [gate | up] or of gate, up."
    attrs = ()

    def activation(self, attrs):
        return "relu"


class Scale(OpKind):
    """x * factor. Linear, so a partial sum stays one (each rank scales its part) and a
    vocabulary-parallel embedding's output is scaled before its reduction."""

    name = "scale"
    doc = "x * factor, a constant or a config expression (Gemma's ${sqrt(hidden_size)} embedding scale)."
    attrs = (Attr("factor", "float", required=True,
                  doc="rounded to the activation dtype before the product, as Hugging Face Gemma does"),)
    any_cut = True

    def rule_tp(self, attrs, ctx):
        return LayoutRule(allowed=_NOT_P, accepts_reduction=True, partial_ok=True)

    def out_segments(self, attrs, in_segments):
        return in_segments[0] if in_segments else ()

    def call(self, node, args, ctx):
        return f"runtime.scale({args[0]}, {float(node.attrs['factor'])!r})"


class Softcap(_Activation):
    name = "softcap"
    doc = "cap * tanh(x / cap): tanh soft-capping (Gemma 2's final logits)."
    attrs = (Attr("cap", "float", required=True, doc="the bound of the output, above 0"),)

    def check(self, attrs, locs, ctx):
        if attrs["cap"] <= 0:
            raise SpecError(locs.get("cap"), f"softcap cap={attrs['cap']} must be above 0")

    def saved_bytes(self, node, local_in, local_out, elt):
        return [(node.outputs[0], numel(local_out[0]) * elt)]  # tanh's backward reads its output

    def hf_knobs(self):
        # Hugging Face caps only the final logits with this (Gemma 2): a config's cap, or its null,
        # must be what the model's soft caps do; without any, none
        key = "final_logit_softcapping"
        return (HFKnob(key, lambda config, n: [config[key]] if key in config else None,
                       lambda a: a["cap"], any=True, absent=None),)

    def call(self, node, args, ctx):
        return f"runtime.softcap({args[0]}, {float(node.attrs['cap'])!r})"


def _clip_qkv(config, n):
    """requested(): clip_qkv, at config.json's top level (OLMo) or in MPT's attn_config: one bound
    for the model, null included (no clamp)."""
    nested = config.get("attn_config")
    block = config if "clip_qkv" in config else nested if isinstance(nested, dict) and "clip_qkv" in nested else None
    return None if block is None else [block["clip_qkv"]]


class Clamp(_Activation):
    name = "clamp"
    doc = "x clamped to [-bound, bound] (MPT's and OLMo's clip_qkv on the fused QKV projection's output)."
    attrs = (Attr("bound", "float", required=True, doc="the output lies in [-bound, bound]; above 0"),)

    def check(self, attrs, locs, ctx):
        if attrs["bound"] <= 0:
            raise SpecError(locs.get("bound"), f"clamp bound={attrs['bound']} must be above 0")

    def hf_knobs(self):
        # Hugging Face clamps only q, k and v with this: a config's bound, or its null, must be what
        # the model's clamps do; without any, none
        return (HFKnob("clip_qkv", _clip_qkv, lambda a: a["bound"], any=True, absent=None),)

    def call(self, node, args, ctx):
        return f"runtime.clamp({args[0]}, {float(node.attrs['bound'])!r})"


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

    def memory_traffic(self, node, local_in, local_out, elt):
        if node.attrs["p"] == 0:
            return 0, 0  # the identity
        # read x, write y and the one-byte mask; backward reads the gradient and the mask, writes one
        forward = numel(local_in[0]) * (2 * elt + 1)
        return forward, forward

    def constructor(self, node, ctx):
        layout = node.in_layouts[0]["tp"]
        stream = "default" if layout in ("I", "R") else "tensor-parallel"
        where = f', layout="{layout}", tp=self.tp' if layout in ("S(s)", "S(h)") and ctx.tp > 1 else ""
        if ctx.cp > 1 and node.in_layouts[0]["cp"] == "S(s)":
            where += ", cp=self.cp"  # TP-invariant masks follow the load-balanced chunks
        return f'runtime.Dropout({node.attrs["p"]!r}, rng_tracker=rng_tracker, stream="{stream}"{where})'

    def call(self, node, args, ctx):
        return f"self.{node.attr_name}({args[0]})"


class Split(OpKind):
    name = "split"
    doc = ("Split the last dim into sections (e.g. a fused QKV output into q, k, v); with heads: N, each of N "
           "heads into the sections (MLA's per-head [nope | rope]), output i holding every head's section i.")
    attrs = (Attr("sections", "int_list", required=True),
             Attr("heads", "int", minimum=1, doc="split head by head: the input is this many heads of sum(sections)"))
    nonlinear = True  # keeps reductions out of the middle of attention
    any_cut = True  # with one section it is the identity; with more it declares its cut

    def out_count(self, attrs):
        return len(attrs["sections"])

    def check(self, attrs, locs, ctx):
        if attrs.get("heads"):
            need_divisible(attrs["heads"], ctx.tp, "heads", locs.get("heads"))

    def memory_traffic(self, node, local_in, local_out, elt):
        if node.attrs.get("heads"):  # strided pieces of each head: copied out
            return 2 * numel(local_in[0]) * elt, 2 * numel(local_in[0]) * elt
        return 0, 0  # views of its input

    def out_shapes(self, attrs, shapes, fail):
        x, n = shapes[0], attrs.get("heads") or 1
        if n * sum(attrs["sections"]) != x[-1]:
            per = f"{n} heads of " if n > 1 else ""
            fail(f"{per}sections {list(attrs['sections'])} sum to {n * sum(attrs['sections'])}, but the input's "
                 f"last dim is {x[-1]}")
        return [tuple(x[:-1]) + (n * s,) for s in attrs["sections"]]

    def input_segments(self, attrs, shapes):
        if attrs.get("heads"):
            return ()  # whole heads on each rank: one slab
        return tuple(attrs["sections"]) if len(attrs["sections"]) > 1 else ()

    def out_units(self, attrs, in_units, in_segments):
        if attrs.get("heads"):
            return [(attrs["heads"],)] * len(attrs["sections"])
        # each section is one of the input's segments, with its heads
        sections, units = tuple(attrs["sections"]), tuple(in_units[0]) if in_units else ()
        if len(units) == len(sections) and (tuple(in_segments[0]) == sections or len(sections) == 1):
            return [(u,) for u in units]
        return [()] * len(sections)

    def call(self, node, args, ctx):
        sections = node.attrs["sections"]
        if node.attrs.get("heads"):
            heads = node.attrs["heads"] // (ctx.tp if node.in_layouts[0]["tp"] == "S(h)" else 1)
            return f"runtime.split({args[0]}, {list(sections)}, heads={heads})"
        if node.in_layouts[0]["tp"] != "S(h)" or ctx.tp == 1:
            return f"runtime.split({args[0]}, {list(sections)})"
        units = ctx.in_units[0] if ctx.in_units else ()
        local = [sh_local_size(n, ctx.tp, (n,), (u,)) for n, u in zip(sections, units)] if len(units) == len(sections) \
            else [n // ctx.tp for n in sections]
        return f"runtime.split({args[0]}, {local})"
