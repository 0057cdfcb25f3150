"""Embeddings: the vocabulary-parallel word embedding and learned absolute positions."""

from __future__ import annotations

from .base import Attr, HFKnob, LayoutRule, OpKind, Weight, need_divisible


def _token_shape(self, attrs, shapes, fail):
    x = shapes[0]
    if len(x) != 2:
        fail(f"expects token ids of shape [batch, sequence], got {list(x)}")
    b, s = x
    return [(s, b, attrs["embedding_dim"])]


class Embedding(OpKind):
    name = "embedding"
    doc = "Word embedding; sharded over the vocabulary under TP (Megatron VocabParallelEmbedding)."
    attrs = (
        Attr("num_embeddings", "int", required=True, minimum=1),
        Attr("embedding_dim", "int", required=True, minimum=1),
        Attr("init_std", "float", default=0.02, minimum=0.0),
        Attr("parallel", "str", default="vocab", choices=("vocab", "none"),
             doc="vocab: rows sharded over TP; none: every rank holds the table (a small one, e.g. BERT's token types)"),
    )
    out_shapes = _token_shape

    def check(self, attrs, locs, ctx):
        if attrs["parallel"] == "vocab":
            need_divisible(attrs["num_embeddings"], ctx.tp, "num_embeddings", locs.get("num_embeddings"),
                           f"pad the vocabulary to a multiple of {ctx.tp}, as Megatron's --make-vocab-size-divisible-by "
                           "does; a small table may use parallel: none")

    def weights(self, attrs):
        shard = 0 if attrs["parallel"] == "vocab" else None
        return [Weight("weight", (attrs["num_embeddings"], attrs["embedding_dim"]), "normal", shard)]

    def rule_tp(self, attrs, ctx):
        if ctx.tp == 1 or attrs["parallel"] == "none":
            return LayoutRule(fixed_inputs=("I",), fixed_outputs=("I",))
        return LayoutRule(fixed_inputs=("I",), fixed_outputs=("P",))

    def rule_cp(self, attrs, ctx):
        return LayoutRule(allowed=("S(s)",))

    def out_seq_dims(self, attrs, in_seq_dims):
        return [0]  # token ids [b, s] in, sequence-first [s, b, h] out

    def constructor(self, node, ctx):
        a = node.attrs
        if a["parallel"] == "none":  # the whole table on every rank, recorded as replicated at any TP size
            return (f"runtime.VocabParallelEmbedding({ctx.attr(node, 'num_embeddings')}, {ctx.attr(node, 'embedding_dim')}, "
                    f"tp=runtime.Group.single(\"tp\"), init_std={ctx.attr(node, 'init_std')}, replicated=True)")
        return (f"runtime.VocabParallelEmbedding({ctx.attr(node, 'num_embeddings')}, {ctx.attr(node, 'embedding_dim')}, "
                f"tp=self.tp, init_std={ctx.attr(node, 'init_std')})")

    def call(self, node, args, ctx):
        return f"self.{node.attr_name}({args[0]})"


class PositionEmbedding(OpKind):
    name = "position_embedding"
    doc = ("Learned absolute position embedding, replicated; takes token ids for their shape, and optionally "
           "position ids [b, s] (packed documents; default 0..s-1).")
    n_inputs = (1, 2)
    packed_input = "position_ids"
    attrs = (
        Attr("num_embeddings", "int", required=True, minimum=1, doc="rows of the table: the maximum sequence length "
             "plus offset"),
        Attr("embedding_dim", "int", required=True, minimum=1),
        Attr("init_std", "float", default=0.02, minimum=0.0),
        Attr("offset", "int", default=0, minimum=0, doc="position p reads row p + offset (OPT's learned positions: 2)"),
    )

    def out_shapes(self, attrs, shapes, fail):
        out = _token_shape(self, attrs, shapes, fail)
        if len(shapes) == 2 and tuple(shapes[1]) != tuple(shapes[0]):
            fail(f"position ids must be shaped as the token ids, {list(shapes[0])}, got {list(shapes[1])}")
        if out[0][0] + attrs["offset"] > attrs["num_embeddings"]:
            fail(f"sequence length {out[0][0]}" + (f" from row {attrs['offset']}" if attrs["offset"] else "")
                 + f" exceeds num_embeddings={attrs['num_embeddings']}")
        return out

    def weights(self, attrs):
        return [Weight("weight", (attrs["num_embeddings"], attrs["embedding_dim"]), "normal")]

    def hf_knobs(self):
        # an architecture's own row offset (OPT's 2), never in config.json: a mapping's import_defaults says it
        key = "position_embedding_offset"
        return (HFKnob(key, lambda config, n: [config[key]] * n if key in config else None, lambda a: a["offset"]),)

    def rule_tp(self, attrs, ctx):
        return LayoutRule(fixed_inputs=("I", "I"), fixed_outputs=("I",))

    def rule_cp(self, attrs, ctx):
        # on a CP shard of the tokens it looks up the positions of this rank's two chunks; position
        # ids (a 2nd input) are the whole sequence's (I), read at the rank's positions
        return LayoutRule(allowed=("S(s)",), joined_inputs=(0,), fixed_inputs=(None, "I"))

    def out_seq_dims(self, attrs, in_seq_dims):
        return [0]

    def constructor(self, node, ctx):
        a = node.attrs
        cp = ", cp=self.cp" if node.in_layouts[0]["cp"] == "S(s)" else ""
        cp += f", offset={a['offset']}" if a["offset"] else ""
        return (f"runtime.PositionEmbedding({ctx.attr(node, 'num_embeddings')}, {ctx.attr(node, 'embedding_dim')}, "
                f"init_std={ctx.attr(node, 'init_std')}{cp})")

    def call(self, node, args, ctx):
        return f"self.{node.attr_name}({', '.join(args)})"
