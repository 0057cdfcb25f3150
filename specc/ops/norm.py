"""Normalization over the last dim, or over each head of it (`head_dim`: Qwen3's and OLMo2's q/k
norms). In a sequence-parallel region each rank normalizes its own rows, so the weights see
rank-divergent inputs and their gradients are partial over TP.

On tensor-parallel shards of the last dim (S(h): the heads of q or k):
* a per-head norm is local: each rank holds whole heads; its [head_dim] weight is used on other
  heads on each rank, so its gradient is partial over TP;
* an RMSNorm over the full width sums the squares of its shard and all-reduces that per-token sum
  (forward, and its gradient in backward): [s, b] floats, where gathering the value would move
  all of it. Its full weight is kept on every rank, each using its slice (a partial gradient).
* a LayerNorm over the full width is not computed on shards: the compiler gathers its input;
* a per-head norm with `gain_per_head` (Cohere Command R+) has a [heads, head_dim] weight sharded
  with the heads: at TP > 1 it runs on the heads' shards only, and its gradient is the rank's own
  (a head replicated over ranks, fewer K heads than ranks, gets its replicas' gradients summed)."""

from __future__ import annotations

from ..errors import SpecError
from ..layouts import has_replicas
from .base import Attr, LayoutRule, OpKind, Weight, numel


class _Norm(OpKind):
    attrs = (
        Attr("hidden_size", "int", required=True, minimum=1, doc="the input's last dim"),
        Attr("eps", "float", default=1e-5, minimum=0.0),
        Attr("zero_centered_gamma", "bool", default=False,
             doc="scale by (1 + weight), the weight starting at 0 (Gemma's RMSNorm; Megatron's name)"),
        Attr("head_dim", "int", minimum=1,
             doc="normalize each head of this size on its own, with one [head_dim] weight for all heads"),
        Attr("gain_per_head", "bool", default=False,
             doc="with head_dim: one weight (and bias) per head, [hidden_size / head_dim, head_dim], sharded with the "
             "heads under TP (Cohere Command R+'s q/k norms)"),
    )
    impls = ("native", "te")
    runtime_class = ""
    sharded_full_width = False  # can it normalize the full width of an S(h) shard (with an all-reduce)
    any_cut = True  # on S(h) each feature keeps its own weight slice, however the shard is cut

    def check(self, attrs, locs, ctx):
        head = attrs.get("head_dim")
        if head is not None and attrs["hidden_size"] % head:
            raise SpecError(locs.get("head_dim"), f"hidden_size={attrs['hidden_size']} is not a multiple of "
                            f"head_dim={head}", "a per-head norm's input is [..., heads * head_dim]")
        if attrs.get("gain_per_head") and head is None:
            raise SpecError(locs.get("gain_per_head"), "gain_per_head needs head_dim (the size of each head)")

    def out_shapes(self, attrs, shapes, fail):
        if shapes[0][-1] != attrs["hidden_size"]:
            fail(f"input has last dim {shapes[0][-1]}, expected hidden_size={attrs['hidden_size']}")
        return [shapes[0]]

    def weight_size(self, attrs) -> int:
        return attrs.get("head_dim") or attrs["hidden_size"]

    def weight(self, name: str, attrs, init: str) -> Weight:
        """[hidden] or [head_dim]; with gain_per_head [heads, head_dim], sharded by heads (replicated
        when there are fewer heads than ranks)."""
        if not attrs.get("gain_per_head"):
            return Weight(name, (self.weight_size(attrs),), init)
        heads = attrs["hidden_size"] // attrs["head_dim"]
        return Weight(name, (heads, attrs["head_dim"]), init, 0, units=(heads,))

    def weight_init(self, attrs) -> str:
        return "zeros" if attrs.get("zero_centered_gamma") else "ones"

    def on_shards(self, attrs, tp: int, units: tuple = ()) -> bool:
        """May the input stay sharded over the last dim (S(h)) at this TP size? `units`: the
        heads of the input's segments (Value.units); a head replicated over ranks is whole."""
        head = attrs.get("head_dim")
        if has_replicas(units, tp):
            # whole heads on every rank; a norm over the full width would count replicas twice
            return head is not None and len(units) == 1 and (attrs["hidden_size"] // units[0]) % head == 0
        if head is not None:
            return (attrs["hidden_size"] // head) % tp == 0  # whole heads on every rank
        return self.sharded_full_width

    def rule_tp(self, attrs, ctx):
        units = tuple(ctx.in_units[0]) if ctx.in_units else ()
        if attrs.get("gain_per_head") and ctx.tp > 1:  # its weights are sharded with the heads
            return LayoutRule(allowed=("S(h)",), accepts_reduction=True)
        allowed = ("I", "R", "S(s)") + (("S(h)",) if self.on_shards(attrs, ctx.tp, units) else ())
        return LayoutRule(allowed=allowed, accepts_reduction=True)

    def partial_grad_weights(self, node, axis, placement):
        if axis == "tp" and placement == "S(h)":  # each rank's shard reaches only its part of the weights
            return [] if node.attrs.get("gain_per_head") else [w.name for w in self.weights(node.attrs)]
        return super().partial_grad_weights(node, axis, placement)

    def collectives(self, node, shapes_on, elt, mesh):
        if mesh.size("tp") == 1 or node.in_layouts[0]["tp"] != "S(h)" or node.attrs.get("head_dim"):
            return [], []
        x = shapes_on("tp")[0]
        stats = numel(x) // x[-1] * max(elt, 4)  # one fp32 sum of squares per token
        return [("all_reduce", stats)], [("all_reduce", stats)]

    def out_segments(self, attrs, in_segments):
        return in_segments[0] if in_segments else ()  # feature by feature: a fused value stays fused

    def saved_bytes(self, node, local_in, local_out, elt):
        return [(node.inputs[0], numel(local_in[0]) * elt)]

    def note(self, node):
        if not node.in_layouts or node.in_layouts[0]["tp"] != "S(h)":
            return ""
        if node.attrs.get("gain_per_head"):
            return f"{node.attr_name} normalizes each local head with its own gain, sharded with the heads"
        if node.attrs.get("head_dim"):
            if not self.weights(node.attrs):
                return f"{node.attr_name} normalizes each local head (no weight)"
            return f"{node.attr_name} normalizes each local head; its weight is shared by the heads of all ranks"
        return (f"{node.attr_name} normalizes over the full width of a sharded value: the sum of squares is "
                "all-reduced per token (its gradient too, in backward)")

    def constructor(self, node, ctx):
        a = node.attrs
        kw = [f"eps={a['eps']!r}"] + self.options(a)
        sharded = node.in_layouts and node.in_layouts[0]["tp"] == "S(h)" and ctx.tp > 1
        if node.impl == "te" and sharded:  # the layout is known only now: the spec pins native there
            raise SpecError(node.loc, f"{node.id}: impl 'te' cannot normalize over a tensor-parallel shard of its "
                            "input (the sum of squares needs an all-reduce)", "use impl: native on it")
        if a.get("head_dim"):
            kw.append(f"head_dim={a['head_dim']}")
            if a.get("gain_per_head"):  # the rank's heads of all of them
                kw.append(f"heads={a['hidden_size'] // a['head_dim']}" + (", tp=self.tp" if sharded else ""))
            segments = ctx.in_segments[0] if sharded and ctx.in_segments else ()
            if len(segments) > 1 and any(n % (ctx.tp * a["head_dim"]) for n in segments):
                raise SpecError(node.loc, f"{node.id}: normalizes heads of {a['head_dim']}, but the tensor-parallel "
                                f"shards of its input are cut by segments {list(segments)} into pieces of other sizes",
                                "split the fused value first, or use segments that are whole heads on every rank")
        if sharded and not a.get("head_dim"):
            kw.append("tp=self.tp")
            segments = ctx.in_segments[0] if ctx.in_segments else ()
            if len(segments) > 1:
                kw.append(f"segments={list(segments)}")
        te = "TE" if node.impl == "te" else ""
        return f"runtime.{te}{self.runtime_class}({a['hidden_size']}, {', '.join(kw)})"

    def impl_unsupported(self, attrs, impl):
        if impl != "te":
            return ""
        if attrs.get("head_dim"):
            return "cannot normalize per head (TransformerEngine's norms span the whole last dim)"
        if not self.te_ok(attrs):
            return "cannot normalize without a bias"
        return ""

    def options(self, attrs) -> list:
        return ["zero_centered_gamma=True"] if attrs.get("zero_centered_gamma") else []

    def te_ok(self, attrs) -> bool:
        return True

    def call(self, node, args, ctx):
        return f"self.{node.attr_name}({args[0]})"


class LayerNorm(_Norm):
    name = "layernorm"
    doc = "LayerNorm, with a bias unless bias: false; per head with head_dim; (1 + weight) with zero_centered_gamma."
    attrs = _Norm.attrs + (Attr("bias", "bool", default=True),)
    runtime_class = "LayerNorm"

    def weights(self, attrs):
        out = [self.weight("weight", attrs, self.weight_init(attrs))]
        if attrs.get("bias", True):
            out.append(self.weight("bias", attrs, "zeros"))
        return out

    def options(self, attrs):
        return super().options(attrs) + ([] if attrs.get("bias", True) else ["bias=False"])

    def te_ok(self, attrs):
        return attrs.get("bias", True)


class RMSNorm(_Norm):
    name = "rmsnorm"
    doc = ("RMSNorm (no bias, no mean subtraction); per head with head_dim; (1 + weight) with "
           "zero_centered_gamma; no weight with elementwise_affine: false; over a tensor-parallel shard with one "
           "all-reduce per token.")
    attrs = _Norm.attrs + (
        Attr("elementwise_affine", "bool", default=True,
             doc="false: normalize only, no weight (Llama 4's q/k norm, transformers' Llama4TextL2Norm)"),)
    runtime_class = "RMSNorm"
    sharded_full_width = True

    def check(self, attrs, locs, ctx):
        super().check(attrs, locs, ctx)
        if not attrs.get("elementwise_affine", True):
            for key in ("zero_centered_gamma", "gain_per_head"):
                if attrs.get(key):
                    raise SpecError(locs.get(key), f"{key} scales by a weight, but elementwise_affine: false has none")

    def weights(self, attrs):
        if not attrs.get("elementwise_affine", True):
            return []
        return [self.weight("weight", attrs, self.weight_init(attrs))]

    def options(self, attrs):
        return super().options(attrs) + ([] if attrs.get("elementwise_affine", True) else ["elementwise_affine=False"])

    def impl_unsupported(self, attrs, impl):
        if impl == "te" and not attrs.get("elementwise_affine", True):
            return "cannot normalize without a weight"
        return super().impl_unsupported(attrs, impl)
