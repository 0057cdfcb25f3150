"""Cross-entropy over the vocabulary. On vocabulary-sharded logits it is Megatron's
vocab-parallel cross-entropy; it is never applied to gathered logits (that would add log t)."""

from __future__ import annotations

from .base import LayoutRule, OpKind, numel


class CrossEntropy(OpKind):
    name = "cross_entropy"
    doc = "Per-token loss [batch, sequence] from logits [s, b, vocab] and labels [b, s]."
    n_inputs = (2, 2)

    def out_shapes(self, attrs, shapes, fail):
        logits, labels = shapes
        if len(logits) != 3 or tuple(labels) != (logits[1], logits[0]):
            fail(f"expects logits [s, b, vocab] and labels [b, s], got {list(logits)} and {list(labels)}")
        return [tuple(labels)]

    def rule_tp(self, attrs, ctx):
        # vocabulary-sharded logits (S(h)) are reduced to the loss without being gathered: an
        # elementwise op before it (a soft cap) should stay on the shards too
        return LayoutRule(allowed=("I", "S(h)"), accepts_reduction=True, joined_inputs=(0,),
                          fixed_inputs=(None, "I"), fixed_outputs=("I",), prefer="S(h)" if ctx.tp > 1 else None)

    def out_dtype(self, attrs):
        return "float32"  # per-token losses in fp32, whatever the activations

    def rule_cp(self, attrs, ctx):
        return LayoutRule(allowed=("S(s)",))  # per token: logits and labels sharded alike

    def out_seq_dims(self, attrs, in_seq_dims):
        return [in_seq_dims[1]]  # the per-token loss has the labels' [b, s] shape

    def note(self, node):
        if node.in_layouts and node.in_layouts[0]["tp"] == "S(h)":
            return "vocab-parallel cross-entropy on sharded logits: two all-reduces of per-token fp32 values inside"
        return ""

    def collectives(self, node, shapes_on, elt, mesh):
        if mesh.size("tp") == 1 or node.in_layouts[0]["tp"] != "S(h)":
            return [], []
        logits = shapes_on("tp")[0]
        s, b = logits[0], logits[1]
        # the max logit per token, then its predicted logit and sum of exponentials together (fp32)
        return [("all_reduce", s * b * 4), ("all_reduce", 2 * s * b * 4)], []

    def saved_bytes(self, node, local_in, local_out, elt):
        return [(node.id + ":softmax", numel(local_in[0]) * 4)]  # fp32 softmax of the local logits

    def call(self, node, args, ctx):
        if node.in_layouts[0]["tp"] == "S(h)":
            return f"runtime.vocab_parallel_cross_entropy({args[0]}, {args[1]}, self.tp)"
        return f'runtime.vocab_parallel_cross_entropy({args[0]}, {args[1]}, runtime.Group.single("tp"))'
