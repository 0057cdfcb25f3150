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

    def rule_tp(self, attrs, ctx):
        return LayoutRule(allowed=("I", "R", "S(h)"))

    def rule_cp(self, attrs, ctx):
        # on a CP shard the rotary module takes the positions of this rank's two chunks
        return LayoutRule(allowed=("S(s)",))

    def out_segments(self, attrs, in_segments):
        return in_segments[0] if in_segments else ()

    def constructor(self, node, ctx):
        cp = ", cp=self.cp" if node.in_layouts[0]["cp"] == "S(s)" else ""
        return f"runtime.RotaryEmbedding({node.attrs['head_dim']}, base={node.attrs['base']!r}{cp})"

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
        Attr("cp_comm_type", "str", default="auto", choices=("auto", "p2p", "all_gather"),
             doc="context parallelism: K/V around a ring of point-to-point sends, or all-gathered; auto: by the cost model"),
    )
    n_inputs = (3, 3)
    nonlinear = True
    impls = ("native", "unfused", "flash", "te")
    selective_recompute = True  # its softmax, mask and dropout output are 5as^2b bytes a layer unfused

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

    def rule_tp(self, attrs, ctx):
        return LayoutRule(allowed=("I", "S(h)"))

    def rule_cp(self, attrs, ctx):
        # S(s): this rank's two load-balanced chunks of q attend to the whole sequence's k, v,
        # which the implementation brings in itself (ring of sends, or an all-gather)
        return LayoutRule(allowed=("S(s)",))

    def cp_comm_type(self, attrs, setting: str = "auto") -> tuple:
        """(p2p | all_gather, why): the spec's pin, then the flag's, then the cost model. Both move
        the same K/V bytes; the ring overlaps them with the block computations and never holds
        the full K/V, so it wins unless K/V are small next to Q (grouped-query attention), where
        one all-gather is cheaper than N-1 latency-bound steps and the full K/V is little memory."""
        pinned = attrs.get("cp_comm_type", "auto")
        if pinned != "auto":
            return pinned, "pinned by the spec"
        if setting != "auto":
            return setting, "pinned by --cp-comm-type"
        if self.kv_heads(attrs) < attrs["num_heads"]:
            return "all_gather", (f"grouped-query attention: K/V have {self.kv_heads(attrs)} of {attrs['num_heads']} "
                                  "heads, one all-gather beats a ring of small steps")
        return "p2p", "ring attention overlaps the K/V exchange with the block computations"

    def choices(self, attrs, settings):
        if settings.cp == 1:
            return {}
        kind, why = self.cp_comm_type(attrs, settings.cp_comm_type)
        return {"cp_comm_type_resolved": kind, "cp_comm_reason": why}

    def collectives(self, node, shapes_on, elt, mesh):
        n = mesh.size("cp")
        if n == 1 or node.in_layouts[0]["cp"] != "S(s)":
            return [], []
        _, k, v = shapes_on("cp")  # local over tp (heads), full sequence
        kv = (numel(k) + numel(v)) * elt
        if node.attrs.get("cp_comm_type_resolved", "p2p") == "all_gather":
            # k and v all-gathered in forward; their gradients reduce-scattered in backward
            return [("all_gather", numel(k) * elt), ("all_gather", numel(v) * elt)], \
                   [("reduce_scatter", numel(k) * elt), ("reduce_scatter", numel(v) * elt)]
        # the ring: N-1 steps, each sends this rank's current K/V block (1/N of the sequence, k and
        # v in one message) on and receives the next; backward circulates K/V again (N-1 steps)
        # and sends the accumulated dK/dV all the way round to their owners (N steps)
        step = kv // n
        fwd = [("send", step), ("recv", step)] * (n - 1)
        bwd = [("send", step), ("recv", step)] * (2 * n - 1)
        return fwd, bwd

    def flops(self, node, local_in, local_out, mesh):
        """Q K^T and the probabilities times V: 2 * 2 * b * s_q * s_k * heads * head_dim forward;
        backward 2x (dQ, dK from the scores' gradient; dV, dP from the output's). Under CP a
        rank's queries meet the whole sequence's keys (s_k = s_q * cp). Causal: the fused
        kernels (SDPA, flash, TE, and the CP ring whatever the impl) skip the blocks above the diagonal, so half the
        pairs count (Megatron's convention, s^2/2; the diagonal blocks they compute in full are
        not counted); the unfused path multiplies the whole s x s matrix and masks it, so all count."""
        q = local_in[0]
        s_q, b = q[0], q[1]
        heads = q[-1] // node.attrs["head_dim"]
        cp = mesh.size("cp") if node.in_layouts and node.in_layouts[0]["cp"] == "S(s)" else 1
        pairs = s_q * s_q * cp
        if node.attrs["causal"] and (node.impl != "unfused" or cp > 1):
            pairs //= 2
        forward = 2 * 2 * b * pairs * heads * node.attrs["head_dim"]
        return forward, 2 * forward

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

    def note(self, node):
        if node.in_layouts and node.in_layouts[0]["cp"] == "S(s)":
            kind = node.attrs.get("cp_comm_type_resolved", "p2p")
            how = "K/V passed around the CP ring" if kind == "p2p" else "K/V all-gathered over CP"
            return f"attention over the whole sequence: {how} inside ({kind}: {node.attrs.get('cp_comm_reason', '')})"
        return ""

    def constructor(self, node, ctx):
        a = node.attrs
        t = ctx.tp if node.in_layouts[0]["tp"] == "S(h)" else 1
        backend = {"native": "sdpa"}.get(node.impl, node.impl)
        extra = ", tp=self.tp" if a["dropout"] > 0 and t > 1 else ""
        if node.in_layouts[0]["cp"] == "S(s)":
            extra += f', cp=self.cp, cp_comm_type="{a.get("cp_comm_type_resolved", "p2p")}"'
        return (f"runtime.CoreAttention({a['num_heads'] // t}, {self.kv_heads(a) // t}, {a['head_dim']}, "
                f"causal={a['causal']}, dropout={a['dropout']!r}, backend=\"{backend}\", rng_tracker=rng_tracker"
                + extra + ")")

    def call(self, node, args, ctx):
        return f"self.{node.attr_name}({', '.join(args)})"
