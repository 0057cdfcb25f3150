"""The Mamba-2 mixer's core (Megatron Core's MambaMixer between in_proj and out_proj): a depthwise
causal conv1d with SiLU on [x | B | C], the chunked SSD scan per head (dt = softplus(dt + dt_bias),
A = -exp(A_log), the skip D), and the RMS norm per group of y * SiLU(z).

It takes the in-projection's output [z | x | B | C | dt] and returns y [..., heads * head_dim]. On
tp, Megatron's sharding: the in-projection is a column-parallel linear with those five segments, so
each rank holds its heads' z, x and dt and its groups' B and C; this op works on that shard (S(h),
cut by the five segments) with no communication and returns its heads' y (S(h)) to a row-parallel
out-projection. Heads and groups must divide by TP (a rank holds whole norm groups, and the B, C
of its heads). With sequence parallelism the compiler gathers before the in-projection and
reduce-scatters after the out-projection, as around attention. Context parallelism is a located
error: the scan runs along the whole sequence (a state passed from chunk to chunk)."""

from __future__ import annotations

from ..errors import SpecError
from .base import Attr, HFKnob, LayoutRule, OpKind, Weight, need_divisible, numel


class Mamba2Mixer(OpKind):
    name = "mamba2_mixer"
    doc = ("Mamba-2 mixer core over the in-projection's [z | x | B | C | dt]: causal depthwise conv1d + SiLU, "
           "chunked SSD scan per head, skip D, RMS norm per group gated by SiLU(z); returns [..., heads*head_dim]. "
           "Heads and groups sharded over tp (S(h) in and out); no context parallelism.")
    attrs = (
        Attr("num_heads", "int", required=True, minimum=1, doc="SSM heads (Megatron --mamba-num-heads)"),
        Attr("head_dim", "int", required=True, minimum=1, doc="features per head (--mamba-head-dim)"),
        Attr("state_size", "int", required=True, minimum=1, doc="SSM state per head (--mamba-state-dim)"),
        Attr("num_groups", "int", default=1, minimum=1,
             doc="groups of heads sharing B and C, and the gated norm's groups (--mamba-num-groups)"),
        Attr("conv_kernel", "int", default=4, minimum=1, doc="the causal conv1d's width"),
        Attr("conv_bias", "bool", default=True),
        Attr("chunk_size", "int", default=128, minimum=1, doc="the SSD scan's chunk length (numerics only)"),
        Attr("norm_eps", "float", default=1e-5, minimum=0.0, doc="the gated RMS norm's epsilon"),
        Attr("dt_min", "float", default=0.0, minimum=0.0, doc="dt is clamped to at least this after the softplus"),
    )
    nonlinear = True

    def sizes(self, attrs) -> tuple:
        """(inner = heads * head_dim, groups * state, heads): the segments' sizes."""
        return attrs["num_heads"] * attrs["head_dim"], attrs["num_groups"] * attrs["state_size"], attrs["num_heads"]

    def check(self, attrs, locs, ctx):
        heads, groups = attrs["num_heads"], attrs["num_groups"]
        if heads % groups:
            raise SpecError(locs.get("num_groups"), f"num_heads={heads} is not a multiple of num_groups={groups}",
                            "each group of B and C serves num_heads / num_groups heads")
        need_divisible(heads, ctx.tp, "num_heads", locs.get("num_heads"))
        if ctx.tp > 1 and groups % ctx.tp:
            inner = heads * attrs["head_dim"]
            raise SpecError(locs.get("num_groups", locs.get("num_heads")),
                            f"num_groups={groups} is not divisible by tensor-model-parallel size {ctx.tp}: the gated "
                            f"norm normalizes groups of {inner // groups} features, and a rank must hold whole groups "
                            f"(and the B and C of its heads)", f"choose a --tensor-model-parallel-size that divides {groups}")

    def check_inputs(self, attrs, shapes, ctx, fail):
        if ctx.cp > 1:
            fail("context parallelism is not supported by the Mamba-2 scan (it carries a state along the whole "
                 "sequence); use --context-parallel-size 1 for this model")

    def out_shapes(self, attrs, shapes, fail):
        inner, gn, heads = self.sizes(attrs)
        want = 2 * inner + 2 * gn + heads
        x = shapes[0]
        if not x or x[-1] != want:
            fail(f"input has last dim {x[-1] if x else None}, expected [z | x | B | C | dt] = "
                 f"{inner} + {inner} + {gn} + {gn} + {heads} = {want}")
        return [tuple(x[:-1]) + (inner,)]

    def weights(self, attrs):
        inner, gn, heads = self.sizes(attrs)
        channels = (inner, gn, gn)  # the conv's [x | B | C]
        out = [Weight("conv1d.weight", (sum(channels), 1, attrs["conv_kernel"]), "normal", 0, channels)]
        if attrs["conv_bias"]:
            out.append(Weight("conv1d.bias", (sum(channels),), "zeros", 0, channels))
        out += [Weight("A_log", (heads,), "ssm_a_log", 0), Weight("D", (heads,), "ones", 0),
                Weight("dt_bias", (heads,), "ssm_dt_bias", 0), Weight("norm.weight", (inner,), "ones", 0)]
        return out

    def hf_knobs(self):
        """The sizes and the activation a Hugging Face Mamba-2 config (mamba_* keys) asks for: the
        groups and the state size can trade off at the same tensor shapes, and only SiLU is modelled."""
        def each(key):
            return lambda config, n: [config[key]] * n if config.get(key) is not None else None

        return (
            HFKnob("mamba_num_heads", each("mamba_num_heads"), lambda a: a["num_heads"]),
            HFKnob("mamba_head_dim", each("mamba_head_dim"), lambda a: a["head_dim"]),
            HFKnob("ssm_state_size", each("ssm_state_size"), lambda a: a["state_size"]),
            HFKnob("n_groups", each("n_groups"), lambda a: a["num_groups"]),
            HFKnob("conv_kernel", each("conv_kernel"), lambda a: a["conv_kernel"]),
            HFKnob("use_conv_bias", each("use_conv_bias"), lambda a: a["conv_bias"]),
            HFKnob("mamba_hidden_act", each("mamba_hidden_act"), lambda a: "silu"),
        )

    def rule_tp(self, attrs, ctx):
        # its weights are always this rank's heads and groups: the input must be the rank's shard
        return LayoutRule(allowed=("S(h)",) if ctx.tp > 1 else ("I",))

    def input_segments(self, attrs, shapes):
        inner, gn, heads = self.sizes(attrs)
        return (inner, inner, gn, gn, heads)

    def saved_bytes(self, node, local_in, local_out, elt):
        # runtime.Mamba2Mixer recomputes its forward in backward: it keeps only its input
        return [(node.inputs[0], numel(local_in[0]) * elt)]

    def flops(self, node, local_in, local_out, mesh):
        """The SSD scan's matrix multiplies on this rank's h heads (head dim p, state n), over
        b * s tokens in chunks of Q (the last one zero-padded): C B^T within each chunk (2 b s Q n h), its masked product
        with x (2 b s Q p h), each chunk's final state B^T x (2 b s n p h), the states passed
        across the (s / Q) chunks (2 b h (s/Q + 1)^2 p n), and C times the entering state
        (2 b s n p h). The depthwise conv, the softplus and the norm are elementwise. Backward:
        twice forward (the gradients; the recomputed forward is not model FLOPs, as elsewhere)."""
        a = node.attrs
        x = local_in[0]
        s = x[0]
        b = numel(x[:-1]) // s if s else 0
        h = a["num_heads"] // (mesh.size("tp") if node.in_layouts and node.in_layouts[0]["tp"] == "S(h)" else 1)
        p, n, q = a["head_dim"], a["state_size"], min(a["chunk_size"], s)
        chunks = -(-s // q) if q else 0
        padded = b * chunks * q  # the last chunk is zero-padded to Q tokens
        forward = 2 * padded * h * (q * n + q * p + 2 * n * p) + 2 * b * h * (chunks + 1) ** 2 * p * n
        return forward, 2 * forward

    def note(self, node):
        return (f"{node.attr_name}: conv1d, SSD scan and gated norm on this rank's heads and groups (no communication); "
                "backward runs its forward again (only the input is kept)")

    def constructor(self, node, ctx):
        a = node.attrs
        kw = [f"num_groups={a['num_groups']}", f"conv_kernel={a['conv_kernel']}", f"chunk_size={a['chunk_size']}",
              f"norm_eps={a['norm_eps']!r}", f"dt_min={a['dt_min']!r}"]
        if not a["conv_bias"]:
            kw.append("conv_bias=False")
        return f"runtime.Mamba2Mixer({a['num_heads']}, {a['head_dim']}, {a['state_size']}, tp=self.tp, {', '.join(kw)})"

    def call(self, node, args, ctx):
        return f"self.{node.attr_name}({args[0]})"
