"""The layout conversion on one mesh axis (specc/layouts.py's table) as an op kind: it has a
contract like every other op, so passes ask it what it needs and makes instead of testing names."""

from __future__ import annotations

from ..layouts import BOUNDARIES
from .base import LayoutRule, OpKind, numel

SUFFIX = {"I": "full", "R": "rep", "S(s)": "seq", "S(h)": "shard", "P": "partial"}
_COLL = {"all_reduce": "all-reduce", "all_gather": "all-gather", "reduce_scatter": "reduce-scatter",
         "split": "split (local)", "": "identity"}


class BoundaryOp(OpKind):
    name = "boundary"
    doc = "A layout conversion on one mesh axis (made by the compiler, not written in specs)."
    internal = True
    any_cut = True

    @staticmethod
    def boundary(node):
        a = node.attrs
        return BOUNDARIES[(a["axis"], a["src"], a["dst"])]

    def converts(self):
        return True

    def rule(self, attrs, ctx):
        if ctx.axis == attrs["axis"]:
            return LayoutRule(fixed_inputs=(attrs["src"],), fixed_outputs=(attrs["dst"],))
        # other axes pass through: whatever arrives leaves
        return LayoutRule(allowed=("I", "R", "S(s)", "S(h)", "P"), accepts_reduction=True, partial_ok=True)

    def undoes(self, node, earlier) -> bool:
        """True when `node` converts back exactly what boundary `earlier` converted (X -> Y -> X on
        one axis, an S(h) shard cut the same way both times)."""
        mine, theirs = self.boundary(earlier), self.boundary(node)
        return (theirs.axis == mine.axis and theirs.dst == mine.src and theirs.src == mine.dst
                and node.attrs.get("segments", ()) == earlier.attrs.get("segments", ()))

    def partial_grad_weights(self, node, axis, placement):
        return []

    def out_segments(self, attrs, in_segments):
        return in_segments[0] if in_segments else ()

    def collectives(self, node, shapes_on, elt, mesh):
        b = self.boundary(node)
        nbytes = numel(shapes_on(b.axis)[0]) * elt
        fwd = [(b.forward, nbytes)] if b.forward in ("all_reduce", "all_gather", "reduce_scatter") else []
        bwd = [(b.backward, nbytes)] if b.backward in ("all_reduce", "all_gather", "reduce_scatter") else []
        if not node.attrs.get("grad", True):
            bwd = []
        return fwd, bwd

    def comm_axis(self, node, collective):
        return node.attrs["axis"]

    def memory_traffic(self, node, local_in, local_out, elt):
        return 0, 0  # its collective is its cost (a split keeps a view)

    def name_suffix(self, node) -> str:
        return SUFFIX[node.attrs["dst"]] if node.attrs["axis"] == "tp" else f"{node.attrs['axis']}_{SUFFIX[node.attrs['dst']]}"

    def label(self, node) -> str:
        return self.boundary(node).label

    def describe(self, node) -> str:
        b = self.boundary(node)
        return f"{b.label}: forward {_COLL[b.forward]}, backward {_COLL[b.backward]}"

    def call(self, node, args, ctx):
        b = self.boundary(node)
        extra = f", {b.kwargs}" if b.kwargs else ""
        if b.seq_dim_kwarg:
            extra += f", dim={node.attrs['seq_dim']}"
        if node.attrs.get("segments"):
            extra += f", segments={list(node.attrs['segments'])}"
        return f"mappings.{b.function}({args[0]}, self.{b.axis}{extra})"
