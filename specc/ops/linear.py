"""Linear layers: column-parallel (output features sharded), row-parallel (input features
sharded, output a partial sum), or replicated."""

from __future__ import annotations

from ..errors import SpecError
from .base import Attr, HFKnob, LayoutRule, OpKind, Weight, need_divisible, numel


class Linear(OpKind):
    name = "linear"
    doc = "y = x W^T + b over the last dim. parallel: column | row | none."
    attrs = (
        Attr("in_features", "int", required=True, minimum=1),
        Attr("out_features", "int", required=True, minimum=1),
        Attr("bias", "bool", default=True),
        Attr("parallel", "str", default="none", choices=("column", "row", "none"),
             doc="column: shard output features (Megatron ColumnParallelLinear); row: shard input features"),
        Attr("segments", "int_list", doc="fused weights (QKV, gate+up): output sizes of each segment; each is sharded on its own"),
        Attr("heads", "int_list", minimum=1,
             doc="column: the attention heads of each segment (or of out_features), never cut inside a head; "
                 "a segment of fewer heads than TP ranks has each head replicated over t/heads ranks "
                 "(grouped-query K/V), TP must divide or be a multiple of each count"),
        Attr("init_std", "float", default=0.02, minimum=0.0),
        Attr("tie", "str", doc="share the weight of another op, e.g. the word embedding"),
    )
    impls = ("native", "te")

    def segments(self, attrs) -> tuple:
        return tuple(attrs.get("segments") or (attrs["out_features"],))

    def check(self, attrs, locs, ctx):
        segs = self.segments(attrs)
        if sum(segs) != attrs["out_features"]:
            raise SpecError(locs.get("segments"), f"segments {list(segs)} sum to {sum(segs)}, not out_features={attrs['out_features']}")
        heads = attrs.get("heads")
        if heads is not None:
            self._check_heads(attrs, segs, heads, locs.get("heads"), ctx)
        elif attrs["parallel"] == "column":
            for s in segs:
                what = "segment size" if len(segs) > 1 else "out_features"
                need_divisible(s, ctx.tp, what, locs.get("segments" if len(segs) > 1 else "out_features"))
        if attrs["parallel"] == "row":
            need_divisible(attrs["in_features"], ctx.tp, "in_features", locs.get("in_features"))
            if attrs.get("segments"):
                raise SpecError(locs.get("segments"), "segments apply to column-parallel linears only")

    def _check_heads(self, attrs, segs, heads, loc, ctx):
        if attrs["parallel"] != "column":
            raise SpecError(loc, "heads apply to column-parallel linears only")
        if len(heads) != len(segs):
            what = f"{len(segs)} segments" if len(segs) > 1 else "one output (out_features, no segments)"
            raise SpecError(loc, f"heads {list(heads)} name {len(heads)} counts, the linear has {what}")
        for i, (size, n) in enumerate(zip(segs, heads)):
            part = f"segment {i} ({size} features)" if len(segs) > 1 else f"out_features={size}"
            if size % n:
                raise SpecError(loc, f"{part} is not a whole number of its {n} heads")
            if n % ctx.tp and ctx.tp % n:
                raise SpecError(loc, f"{part} has {n} heads, and tensor-model-parallel size {ctx.tp} neither divides "
                                f"them nor is a multiple of them (a rank holds whole heads, or one head "
                                f"replicated over tp/heads ranks)",
                                f"choose a --tensor-model-parallel-size that divides or is a multiple of {n}")

    def out_shapes(self, attrs, shapes, fail):
        x = shapes[0]
        if not x or x[-1] != attrs["in_features"]:
            fail(f"input has last dim {x[-1] if x else None}, expected in_features={attrs['in_features']}")
        return [tuple(x[:-1]) + (attrs["out_features"],)]

    def weights(self, attrs):
        mode = attrs["parallel"]
        shape = (attrs["out_features"], attrs["in_features"])
        segs = self.segments(attrs)
        units = tuple(attrs.get("heads") or ()) if mode == "column" else ()
        out = []
        if not attrs.get("tie"):
            shard = {"column": 0, "row": 1}.get(mode)
            out.append(Weight("weight", shape, "normal", shard, segs if mode == "column" else (), units=units))
        if attrs["bias"]:
            out.append(Weight("bias", (attrs["out_features"],), "zeros",
                              0 if mode == "column" else None, segs if mode == "column" else (), units=units))
        return out

    def rule_tp(self, attrs, ctx):
        mode = attrs["parallel"]
        if ctx.tp == 1 or mode == "none":
            return LayoutRule(allowed=("I", "R", "S(s)"), accepts_reduction=True)
        if mode == "column":
            return LayoutRule(fixed_inputs=("R",), fixed_outputs=("S(h)",))
        return LayoutRule(fixed_inputs=("S(h)",), fixed_outputs=("P",))

    def absorbable(self, attrs):
        # Megatron's column GEMM gathers its sequence-parallel input itself, and all-reduces the
        # input gradient of a replicated input while the weight gradient is computed
        if attrs["parallel"] != "column":
            return {}
        return {("tp", "S(s)", "R"): "gather", ("tp", "I", "R"): "copy"}

    def out_segments(self, attrs, in_segments):
        segs = self.segments(attrs)
        return segs if len(segs) > 1 else ()

    def out_units(self, attrs, in_units, in_segments):
        return [tuple(attrs.get("heads") or ()) if attrs["parallel"] == "column" else ()]

    def followers(self, attrs):
        # a row-parallel linear's bias is added after the reduction of its partial sums
        if attrs["parallel"] == "row" and attrs.get("bias"):
            return [("bias_add", {"size": attrs["out_features"]})]
        return []

    def hf_knobs(self):
        # whether the output layer shares the word embedding's weight
        return (HFKnob("tie_word_embeddings",
                       lambda config, n: None if config.get("tie_word_embeddings") is None else [config["tie_word_embeddings"]],
                       lambda a: bool(a.get("tie")), any=True),)

    def tie_contract(self, attrs) -> tuple:
        """(the shape of the weight it shares, the dim TP shards it on) for `tie:` checks."""
        return (attrs["out_features"], attrs["in_features"]), {"column": 0, "row": 1}.get(attrs["parallel"])

    def note(self, node):
        notes = []
        for a in node.absorbed[:1]:
            if a.mode == "gather":
                notes.append(f"{node.attr_name} all-gathers its S(s) input over the sequence inside the GEMM "
                             "(backward: re-gather, reduce-scatter of the input gradient overlapped with the weight gradient)")
            else:
                notes.append(f"{node.attr_name} takes an I input as R (backward: all-reduce of the input gradient, "
                             "overlapped with the weight-gradient GEMM)")
        replicated = self.replicated_segments(node)
        if replicated:
            t = node.out_layouts[0].mesh.size("tp")
            which = ", ".join(f"segment {i}: {n} head{'s' if n > 1 else ''} on {t} ranks, each on {t // n}"
                              for i, n in replicated)
            notes.append(f"{node.attr_name} replicates heads ({which}); their weight gradients are summed over TP "
                         "in a zero-padded buffer with the TP-partial gradients")
        return "; ".join(notes)

    def replicated_segments(self, node) -> list:
        """[(segment index, heads)] of the segments whose heads are fewer than the TP ranks."""
        heads = node.attrs.get("heads") or ()
        if node.attrs["parallel"] != "column" or not heads or not node.out_layouts:
            return []
        t = node.out_layouts[0].mesh.size("tp")
        return [(i, n) for i, n in enumerate(heads) if n < t]

    def collectives(self, node, shapes_on, elt, mesh):
        nbytes = numel(shapes_on("tp")[0]) * elt  # the TP collectives move the CP-local sequence
        fwd, bwd = [], []
        for a in node.absorbed:
            if a.mode == "gather":  # all-gather in; backward re-gathers the saved shard, reduce-scatters dgrad
                fwd.append(("all_gather", nbytes))
                bwd += [("all_gather", nbytes), ("reduce_scatter", nbytes)]
            elif a.mode == "copy":  # backward all-reduces dgrad, overlapped with the wgrad GEMM
                bwd.append(("all_reduce", nbytes))
        return fwd, bwd

    def comm_hidden(self, node):
        # runtime/layers.py: forward gathers before the GEMM; backward re-gathers beside the
        # grad-input GEMM and reduce-scatters (or all-reduces) grad-input beside the weight-gradient
        # GEMM, half of backward's multiply time; a copy's all-reduce runs beside the wgrad GEMM only
        modes = {a.mode for a in node.absorbed}
        return 0.0, (1.0 if "gather" in modes else 0.5 if "copy" in modes else 0.0)

    def memory_traffic(self, node, local_in, local_out, elt):
        return 0, 0  # a GEMM (its bias added in the GEMM's epilogue): `flops` times it

    def saved_bytes(self, node, local_in, local_out, elt):
        # the weight gradient needs the input; an absorbed sequence gather keeps only the shard
        return [(node.inputs[0], numel(local_in[0]) * elt)]

    def flops(self, node, local_in, local_out, mesh):
        # forward x W^T over this rank's rows of the output and its slice of the input features
        # (an absorbed sequence gather multiplies the gathered rows: count the output's);
        # backward the input gradient and the weight gradient, one GEMM of that size each
        forward = 2 * numel(local_out[0]) * local_in[0][-1]
        return forward, 2 * forward

    def constructor(self, node, ctx):
        a = node.attrs
        args = [ctx.attr(node, "in_features"), ctx.attr(node, "out_features")]
        kw = [f"bias={a['bias']}"]
        mode = a["parallel"]  # at TP=1 the same classes run with a group of one
        te = "TE" if node.impl == "te" else ""  # TE kernels behind the same contract (runtime/te.py)
        if mode == "row":
            return f"runtime.{te}RowParallelLinear({', '.join(args + kw)}, tp=self.tp, init_std={ctx.attr(node, 'init_std')})"
        tp = "self.tp" if mode == "column" else 'runtime.Group.single("tp")'
        if a.get("segments") and mode == "column":
            kw.append(f"segments={list(a['segments'])}")
        if a.get("heads") and mode == "column":
            kw.append(f"heads={list(a['heads'])}")
        if node.absorbed:
            kw.append(f'input_mode="{node.absorbed[0].mode}"')
        if node.tied_to:
            kw.append(f"weight={ctx.tied_expr}")
        if mode == "none":  # every rank holds the whole weight: recorded as replicated at any TP size
            kw.append("replicated=True")
        return f"runtime.{te}ColumnParallelLinear({', '.join(args + kw)}, tp={tp}, init_std={ctx.attr(node, 'init_std')})"

    def call(self, node, args, ctx):
        return f"self.{node.attr_name}({args[0]})"


class BiasAdd(OpKind):
    """The bias of a row-parallel linear, added after its partial sums are reduced (adding it
    before would count it t times). Made by the compiler, not written in specs."""

    name = "bias_add"
    internal = True
    attrs = (Attr("size", "int", required=True),)

    def rule_tp(self, attrs, ctx):
        # on partial sums (P) the bias joins on one rank only, so the sum over ranks adds it once:
        # partial sums of a parallel block can then still meet before a single reduction
        return LayoutRule(allowed=("I", "S(s)"), accepts_reduction=True, partial_ok=True)

    def shared_weights(self, attrs):
        return [Weight("bias", (attrs["size"],), "zeros")]

    def partial_grad_weights(self, node, axis, placement):
        # added on one rank to partial sums, or to rank-divergent values: a partial gradient
        if placement in ("R", "S(s)") or (placement == "P" and axis == "tp"):
            return ["bias"]
        return []

    def owner(self, node) -> str:
        """The submodule that holds this bias (the row-parallel linear)."""
        return node.attrs["owner_attr"]

    def memory_traffic(self, node, local_in, local_out, elt):
        """Forward reads x and writes x + bias. Backward hands the output's gradient to x as it is
        (no kernel) and sums it over the tokens for the bias's gradient: one read."""
        out = sum(numel(s) for s in local_out) * elt
        return sum(numel(s) for s in local_in) * elt + out, out

    def note(self, node) -> str:
        if node.in_layouts and node.in_layouts[0]["tp"] == "P":
            return "the bias joins the partial sums on one rank only, so the sum over ranks adds it once"
        return ""

    def call(self, node, args, ctx):
        bias = f"self.{node.attrs['owner_attr']}.bias"
        if node.in_layouts and node.in_layouts[0]["tp"] == "P":
            return f"{args[0]} + {bias} * float(self.tp.rank == 0)"
        return f"{args[0]} + {bias}"
