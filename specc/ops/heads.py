"""Ops that join values along the last dim, or head by head, and hand one head to every head:
what multi-latent attention (DeepSeek-V2/V3, Megatron's MLA) needs to build its q/k heads of
[nope | rope] features from a per-head projection and one shared rope key.

Heads are TP's unit: on S(h) each rank holds whole heads of every input, so a per-head join is
the same on each rank's heads as on the whole. A plain join runs on unsharded features (its
inputs are gathered from S(h) first)."""

from __future__ import annotations

from .base import Attr, LayoutRule, OpKind, need_divisible, numel


def _local_heads(node, heads: int, tp: int) -> int:
    return heads // tp if tp > 1 and node.out_layouts[0]["tp"] == "S(h)" else heads


class Concat(OpKind):
    name = "concat"
    doc = ("Join values along the last dim; with heads: N, head by head: head h of the output is [head h of each "
           "input] (each input N heads; MLA's q = [q_nope | q_rope] per head).")
    attrs = (Attr("heads", "int", minimum=1, doc="join head by head: every input holds this many heads"),)
    n_inputs = (2, 16)
    nonlinear = True  # keeps reductions out of the middle of attention, as split does

    def check(self, attrs, locs, ctx):
        if attrs.get("heads"):
            need_divisible(attrs["heads"], ctx.tp, "heads", locs.get("heads"))

    def out_shapes(self, attrs, shapes, fail):
        lead = shapes[0][:-1]
        for s in shapes[1:]:
            if s[:-1] != lead:
                fail(f"inputs differ in their leading dims: {list(shapes[0])} and {list(s)}")
        n = attrs.get("heads")
        if n:
            for i, s in enumerate(shapes):
                if s[-1] % n:
                    fail(f"input {i} has last dim {s[-1]}, not {n} whole heads")
        return [tuple(lead) + (sum(s[-1] for s in shapes),)]

    def out_units(self, attrs, in_units, in_segments):
        if attrs.get("heads"):
            return [(attrs["heads"],)]
        return [()]

    def saved_bytes(self, node, local_in, local_out, elt):
        return []  # backward splits the gradient

    def rule_tp(self, attrs, ctx):
        if attrs.get("heads"):
            return LayoutRule(allowed=("I", "R", "S(s)", "S(h)"))
        # a plain join of S(h) shards would be a fused value whose segments the compiler does not
        # track for a concat: join it anywhere but on head shards
        return LayoutRule(allowed=("I", "R", "S(s)"))

    def call(self, node, args, ctx):
        n = node.attrs.get("heads")
        if not n:
            return f"runtime.concat({', '.join(args)})"
        return f"runtime.concat({', '.join(args)}, heads={_local_heads(node, n, ctx.tp)})"


class ExpandHeads(OpKind):
    name = "expand_heads"
    doc = ("One head [s, b, d] given to every one of num_heads heads [s, b, num_heads*d] (MLA's shared rope key "
           "k_pe); backward sums the heads' gradients. Under TP: R in, each rank's heads out (S(h)).")
    attrs = (Attr("num_heads", "int", required=True, minimum=1),)

    def check(self, attrs, locs, ctx):
        need_divisible(attrs["num_heads"], ctx.tp, "num_heads", locs.get("num_heads"))

    def out_shapes(self, attrs, shapes, fail):
        return [tuple(shapes[0][:-1]) + (attrs["num_heads"] * shapes[0][-1],)]

    def out_units(self, attrs, in_units, in_segments):
        return [(attrs["num_heads"],)]

    def rule_tp(self, attrs, ctx):
        if ctx.tp == 1:
            return LayoutRule(allowed=("I", "R", "S(s)"), accepts_reduction=True)
        # like a column-parallel GEMM: the head's gradient is a sum over every rank's heads, so
        # the input is R (its gradient partial over TP) and the output this rank's heads
        return LayoutRule(fixed_inputs=("R",), fixed_outputs=("S(h)",))

    def memory_traffic(self, node, local_in, local_out, elt):
        # forward writes the copies; backward reads their gradients and writes the sum
        return numel(local_out[0]) * elt, (numel(local_out[0]) + numel(local_in[0])) * elt

    def call(self, node, args, ctx):
        return f"runtime.expand_heads({args[0]}, {_local_heads(node, node.attrs['num_heads'], ctx.tp)})"
