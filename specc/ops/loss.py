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

    def working_bytes(self, node, local_in, local_out, elt, mesh):
        """The loss's temporaries beyond the fp32 softmax it keeps (runtime/cross_entropy.py), in
        L = the local logits' elements. Both paths hold the incoming logits (elt L) and, from
        16-bit logits, their fp32 copy (4 L) while the fp32 result is made. Vocab-parallel (TP > 1,
        sharded logits): forward `shifted - row_max` is a new fp32 tensor (4 L, it becomes the
        kept softmax), so elt L + copy beyond it; backward clones the softmax into the gradient
        (4 L) and casts it to the logits' dtype (elt L from 16-bit). Whole vocabulary
        (F.cross_entropy): forward log_softmax's fp32 output (the kept 4 L) beside the logits and
        their copy; backward nll_loss's fp32 gradient and log_softmax's (8 L) beside the kept
        output. Returns the larger of forward's and backward's."""
        n = numel(local_in[0])
        copy = 4 * n if elt < 4 else 0
        forward = elt * n + copy
        if mesh.size("tp") > 1 and node.in_layouts[0]["tp"] == "S(h)":
            backward = 4 * n + (elt * n if elt < 4 else 0)
        else:
            backward = 8 * n
        return max(forward, backward)

    def call(self, node, args, ctx):
        if node.in_layouts[0]["tp"] == "S(h)":
            return f"runtime.vocab_parallel_cross_entropy({args[0]}, {args[1]}, self.tp)"
        return f'runtime.vocab_parallel_cross_entropy({args[0]}, {args[1]}, runtime.Group.single("tp"))'
