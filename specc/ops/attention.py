"""Rotary position embedding and core (dot-product) attention. Heads are the unit of tensor
parallelism: S(h) on q, k, v means each rank holds whole heads."""

from __future__ import annotations

from .base import Attr, LayoutRule, OpKind, need_divisible, numel


class Rotary(OpKind):
    name = "rotary"
    doc = "Rotary position embedding (rotate-half) over [s, b, heads*head_dim]."
    attrs = (
        Attr("head_dim", "int", required=True, minimum=2),
        Attr("base", "float", default=10000.0, minimum=1.0),
    )
    nonlinear = True  # position-dependent: needs the whole sequence on each rank

    def out_shapes(self, attrs, shapes, fail):
        if shapes[0][-1] % attrs["head_dim"] or attrs["head_dim"] % 2:
            fail(f"last dim {shapes[0][-1]} is not a whole number of even heads of head_dim={attrs['head_dim']}")
        return [shapes[0]]

    def rule(self, attrs, ctx):
        return LayoutRule(allowed=("I", "R", "S(h)"))

    def constructor(self, node, ctx):
        return f"runtime.RotaryEmbedding({node.attrs['head_dim']}, base={node.attrs['base']!r})"

    def call(self, node, args, ctx):
        return f"self.{node.attr_name}({args[0]})"


class CoreAttention(OpKind):
    name = "core_attention"
    doc = "softmax(q k^T / sqrt(d)) v over [s, b, heads*head_dim]; grouped-query when num_kv_heads < num_heads."
    attrs = (
        Attr("num_heads", "int", required=True, minimum=1),
        Attr("num_kv_heads", "int", minimum=1, doc="defaults to num_heads"),
        Attr("head_dim", "int", required=True, minimum=1),
        Attr("causal", "bool", default=True),
        Attr("dropout", "float", default=0.0, minimum=0.0),
    )
    n_inputs = (3, 3)
    nonlinear = True
    impls = ("native", "unfused", "flash", "te")

    def kv_heads(self, attrs) -> int:
        return attrs.get("num_kv_heads") or attrs["num_heads"]

    def check(self, attrs, locs, ctx):
        need_divisible(attrs["num_heads"], ctx.tp, "num_heads", locs.get("num_heads"))
        need_divisible(self.kv_heads(attrs), ctx.tp, "num_kv_heads", locs.get("num_kv_heads", locs.get("num_heads")))

    def out_shapes(self, attrs, shapes, fail):
        nh, ng, d = attrs["num_heads"], self.kv_heads(attrs), attrs["head_dim"]
        if nh % ng:
            fail(f"num_heads={nh} is not a multiple of num_kv_heads={ng}")
        want = [nh * d, ng * d, ng * d]
        for name, shape, n in zip("qkv", shapes, want):
            if shape[-1] != n:
                fail(f"{name} has last dim {shape[-1]}, expected {n} heads*head_dim")
        if shapes[1][:-1] != shapes[0][:-1] or shapes[2][:-1] != shapes[0][:-1]:
            fail("q, k and v must share their [sequence, batch] dims")
        return [shapes[0]]

    def rule(self, attrs, ctx):
        return LayoutRule(allowed=("I", "S(h)"))

    def saved_bytes(self, node, local_in, local_out, elt):
        q, k, v = local_in
        s, b = q[0], q[1]
        heads = q[-1] // node.attrs["head_dim"]
        saved = [(node.inputs[0], numel(q) * elt), (node.inputs[1], numel(k) * elt), (node.inputs[2], numel(v) * elt)]
        if node.impl == "unfused":
            scores = heads * s * s * b
            saved.append((node.id + ":softmax", scores * elt))
            if node.attrs["dropout"] > 0:
                saved += [(node.id + ":mask", scores), (node.id + ":dropout", scores * elt)]
        else:  # fused kernels keep the output and the row log-sum-exp, never the s x s scores
            saved += [(node.outputs[0], numel(local_out[0]) * elt), (node.id + ":lse", heads * s * b * 4)]
        return saved

    def constructor(self, node, ctx):
        a = node.attrs
        t = ctx.tp
        backend = {"native": "sdpa"}.get(node.impl, node.impl)
        return (f"runtime.CoreAttention({a['num_heads'] // t}, {self.kv_heads(a) // t}, {a['head_dim']}, "
                f"causal={a['causal']}, dropout={a['dropout']!r}, backend=\"{backend}\", rng_tracker=rng_tracker"
                + (", tp=self.tp)" if a["dropout"] > 0 and t > 1 else ")"))

    def call(self, node, args, ctx):
        return f"self.{node.attr_name}({', '.join(args)})"
