"""Rotary position embedding and core (dot-product) attention. Heads are the unit of tensor
parallelism: S(h) on q, k, v means each rank holds whole heads."""

from __future__ import annotations

import math

from ..errors import SpecError
from ..layouts import DTYPE_BYTES, cp_chunk_pair
from .base import Attr, HFKnob, LayoutRule, OpKind, need_divisible, numel
from .rotary import _rope  # noqa: F401 (the rope settings, for attention's own knobs that read them)


def _each(key: str):
    """requested(): config.json's `key` for every op, when it has the key."""
    return lambda config, n: [config[key]] * n if key in config else None


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _mscale_squared(config, n):
    """requested(): DeepSeek's softmax scale is 1/sqrt(head_dim) times mscale^2 when its rope is
    scaled with mscale_all_dim (transformers' yarn_apply_mscale: 0.1 * mscale_all_dim * ln(factor)
    + 1 for a factor above 1). None without it (a family's own scale, Gemma's
    query_pre_attn_scalar, is another knob)."""
    rope = _rope(config)
    mscale_all_dim, factor = rope.get("mscale_all_dim"), rope.get("factor")
    if rope.get("rope_type", "default") == "default" or not mscale_all_dim:
        return None
    if not isinstance(factor, (int, float)) or not isinstance(mscale_all_dim, (int, float)):
        return [f"rope factor {factor!r} with mscale_all_dim {mscale_all_dim!r}"] * n  # no op models it
    mscale = 1.0 if factor <= 1 else 0.1 * mscale_all_dim * math.log(factor) + 1.0
    return [mscale * mscale] * n


def _attn_config(key: str):
    """requested(): config.json's `key`, at its top level or in MPT's attn_config, for every op."""
    def requested(config, n):
        nested = config.get("attn_config")
        block = config if key in config else nested if isinstance(nested, dict) and key in nested else None
        return None if block is None else [block[key]] * n
    return requested


def _chunks(config, n):
    """Per layer: Llama 4's attention_chunk_size where layer_types says chunked_attention (or, in
    files without it, no_rope_layers has a 1: its rope layers are the chunked ones), none
    elsewhere. An empty or missing no_rope_layers beside no_rope_layer_interval is what
    transformers makes of it: every interval-th layer without rope (Llama4TextConfig)."""
    size, types = config.get("attention_chunk_size"), config.get("layer_types")
    if not isinstance(types, list) or not types:
        flags = config.get("no_rope_layers")
        interval = config.get("no_rope_layer_interval")
        if not (isinstance(flags, list) and flags) and _is_int(interval) and interval > 0:
            flags = [int((i + 1) % interval != 0) for i in range(n)]
        if not (isinstance(flags, list) and flags):
            return None if size is None else [size] * n
        types = ["chunked_attention" if f else "full_attention" for f in flags]
    return [size if types[i % len(types)] == "chunked_attention" else None for i in range(n)]


def _windows(config, n):
    """Per layer: Hugging Face's sliding_window where layer_types says sliding_attention (or
    everywhere without layer_types), none where it says full_attention (or the older "attention")
    or use_sliding_window is off, or chunked_attention (the chunk knob's); another layer type is
    asked for by its name, which no op models. A list shorter than the layers (a mapping's import_defaults: the
    pattern transformers fills in for older files) repeats."""
    window = config.get("sliding_window")
    types = config.get("layer_types")
    if isinstance(types, list) and types and len(types) <= n:
        full = ("full_attention", "attention", "chunked_attention")
        return [window if t == "sliding_attention" else None if t in full else t
                for t in (types[i % len(types)] for i in range(n))]
    if config.get("use_sliding_window") is False:
        return [None] * n
    return [window] * n if "sliding_window" in config else None


class CoreAttention(OpKind):
    name = "core_attention"
    doc = ("softmax(q k^T * scale) v over [s, b, heads*head_dim]; grouped-query when num_kv_heads < num_heads; "
           "causal or bidirectional, a sliding window (per layer with window_pattern), tanh soft-capped scores; "
           "an optional 4th input, document ids [b, s], keeps each token within its document (padding masks)")
    attrs = (
        Attr("num_heads", "int", required=True, minimum=1),
        Attr("num_kv_heads", "int", minimum=1, doc="defaults to num_heads"),
        Attr("head_dim", "int", required=True, minimum=1, doc="of q and k"),
        Attr("v_head_dim", "int", minimum=1, doc="of v and the output, when apart from head_dim (multi-latent "
             "attention: q/k heads of nope + rope features, narrower values); sdpa and unfused only, no CP"),
        Attr("causal", "bool", default=True),
        Attr("dropout", "float", default=0.0, minimum=0.0),
        Attr("window", "int", minimum=1, doc="sliding window: each query sees the `window` latest keys, itself included; "
             "with causal: false the keys less than `window` positions away either side (Gemma 3's bidirectional window)"),
        Attr("window_pattern", "int_list", minimum=0, doc="per layer of the enclosing repeat, cycled: the window of layer i is "
             "window_pattern[i % len], 0 for full attention (Gemma 2: [4096, 0])"),
        Attr("scale", "float", minimum=0.0, doc="the score scale; default 1/sqrt(head_dim)"),
        Attr("softcap", "float", minimum=0.0, doc="scores become softcap * tanh(scores / softcap) (Gemma 2)"),
        Attr("chunk", "int", minimum=1, doc="chunked attention (Llama 4's attention_chunk_size): a query sees only "
             "the keys of its own chunk of `chunk` positions"),
        Attr("chunk_pattern", "int_list", minimum=0, doc="per layer of the enclosing repeat, cycled: the chunk of "
             "layer i is chunk_pattern[i % len], 0 for full attention (Llama 4: [8192, 8192, 8192, 0])"),
        Attr("alibi", "bool", default=False, doc="ALiBi (BLOOM, MPT): slope_h * (j - i) added to the scores, slope_h "
             "by the global query head index (the same at any TP, CP, GQA)"),
        Attr("alibi_max_bias", "float", default=8.0, minimum=0.0,
             doc="ALiBi's slopes are 2^(-alibi_max_bias * k / n) (MPT's alibi_bias_max; BLOOM's is 8)"),
        Attr("cp_comm_type", "str", default="auto", choices=("auto", "p2p", "all_gather"),
             doc="context parallelism: K/V around a ring of point-to-point sends, or all-gathered; auto: by the cost model"),
    )
    n_inputs = (3, 4)
    packed_input = "document_ids"  # --reset-attention-mask: the 4th input
    nonlinear = True
    impls = ("native", "unfused", "flash", "te")
    selective_recompute = True  # its softmax, mask and dropout output are 5as^2b bytes a layer unfused

    def kv_heads(self, attrs) -> int:
        return attrs.get("num_kv_heads") or attrs["num_heads"]

    def v_dim(self, attrs) -> int:
        return attrs.get("v_head_dim") or attrs["head_dim"]

    def local_kv_heads(self, attrs, t: int) -> int:
        """K/V heads on one of t ranks: a share of them, or one replicated head when there are
        fewer than t (each serves the rank's query heads: q heads r*nh/t.. read KV head r//(t/n))."""
        return max(1, self.kv_heads(attrs) // t)

    def check(self, attrs, locs, ctx):
        need_divisible(attrs["num_heads"], ctx.tp, "num_heads", locs.get("num_heads"))
        n, loc = self.kv_heads(attrs), locs.get("num_kv_heads", locs.get("num_heads"))
        if ctx.tp > 1 and n % ctx.tp and ctx.tp % n:
            raise SpecError(loc, f"num_kv_heads={n} is neither divisible by tensor-model-parallel size {ctx.tp} nor "
                            f"divides it (fewer key/value heads than ranks are replicated: tp/num_kv_heads ranks "
                            f"hold each)", f"choose a --tensor-model-parallel-size that divides or is a multiple of {n}")
        if attrs.get("window") and attrs.get("window_pattern"):
            raise SpecError(locs.get("window_pattern"), "give window or window_pattern, not both")
        if attrs.get("chunk") and attrs.get("chunk_pattern"):
            raise SpecError(locs.get("chunk_pattern"), "give chunk or chunk_pattern, not both")
        if ctx.cp > 1 and self.v_dim(attrs) != attrs["head_dim"]:
            raise SpecError(locs.get("v_head_dim"), f"v_head_dim={attrs['v_head_dim']} apart from head_dim="
                            f"{attrs['head_dim']} is not wired for context parallelism (the ring and all-gather "
                            "paths take one head dim)", "run without --context-parallel-size")

    def hf_knobs(self):
        def bidirectional(config, n):
            flag = config.get("use_bidirectional_attention")
            return [not flag] * n if isinstance(flag, bool) else None

        return (
            HFKnob("sliding_window", _windows, lambda a: a.get("window")),
            HFKnob("attn_logit_softcapping", _each("attn_logit_softcapping"), lambda a: a.get("softcap")),
            HFKnob("query_pre_attn_scalar",
                   lambda config, n: [config["query_pre_attn_scalar"] ** -0.5] * n
                   if config.get("query_pre_attn_scalar") else None,
                   lambda a: a.get("scale") or a["head_dim"] ** -0.5),
            HFKnob("use_bidirectional_attention (causal)", bidirectional, lambda a: a["causal"]),
            HFKnob("alibi", _attn_config("alibi"), lambda a: a["alibi"]),
            HFKnob("alibi_bias_max", _attn_config("alibi_bias_max"), lambda a: a["alibi_max_bias"] if a["alibi"] else None),
            # MPT's score scale (null: 1/sqrt(head_dim)): the spec's scale, or none
            HFKnob("softmax_scale", _attn_config("softmax_scale"), lambda a: a.get("scale")),
            HFKnob("attention_chunk_size", _chunks, lambda a: a.get("chunk")),
            # multi-latent attention (DeepSeek): q/k heads of nope + rope features, values apart
            HFKnob("qk_nope_head_dim + qk_rope_head_dim",
                   lambda config, n: [config["qk_nope_head_dim"] + config["qk_rope_head_dim"]] * n
                   if _is_int(config.get("qk_nope_head_dim")) and _is_int(config.get("qk_rope_head_dim")) else None,
                   lambda a: a["head_dim"]),
            HFKnob("v_head_dim", lambda config, n: [config["v_head_dim"]] * n if _is_int(config.get("v_head_dim"))
                   else None, self.v_dim),
            HFKnob("the score scale over 1/sqrt(head_dim) (rope mscale_all_dim)", _mscale_squared,
                   lambda a: (a.get("scale") or a["head_dim"] ** -0.5) / a["head_dim"] ** -0.5),
        )

    def impl_unsupported(self, attrs, impl):
        # runtime.CoreAttention wires flash-attn's and TransformerEngine's kernels for the plain
        # causal or bidirectional softmax over one head dim only
        asked = [k for k in ("window", "window_pattern", "scale", "softcap", "chunk", "chunk_pattern", "alibi")
                 if attrs.get(k)]
        if self.v_dim(attrs) != attrs["head_dim"]:
            asked.append("v_head_dim apart from head_dim")
        if impl in ("flash", "te") and asked:
            return f"is not wired for {', '.join(asked)} (the native path computes them)"
        return ""

    def inputs_unsupported(self, n_inputs, impl):
        # runtime.CoreAttention hands flash-attn and TransformerEngine no mask of document ids
        if impl in ("flash", "te") and n_inputs == 4:
            return "takes no document ids (the 4th input: packed documents, a padding mask); the native path masks by them"
        return ""

    def instance_attrs(self, attrs, layer, fail):
        for key, value in (("window_pattern", "window"), ("chunk_pattern", "chunk")):
            if attrs.get(key):
                if layer is None:
                    fail(f"{key} needs the attention inside a repeated module (it is indexed by the layer)")
                attrs = {**attrs, value: attrs[key][layer % len(attrs[key])] or None}
        return attrs

    def check_units(self, attrs, in_units, ctx):
        n = self.kv_heads(attrs)
        if ctx.tp <= n:
            return None
        for name, units in zip("kv", in_units[1:3]):
            if tuple(units) != (n,):
                have = f"carries heads {list(units)}" if units else "does not say its heads"
                return ("num_kv_heads", f"num_kv_heads={n} is below tensor-model-parallel size {ctx.tp}, so each rank "
                        f"needs one whole {name} head, replicated over {ctx.tp // n} ranks, but {name} {have}: declare "
                        f"heads: on the linear that makes it (e.g. heads: [num_heads, {n}, {n}] on a fused QKV)")
        return None

    def out_shapes(self, attrs, shapes, fail):
        nh, ng, d, dv = attrs["num_heads"], self.kv_heads(attrs), attrs["head_dim"], self.v_dim(attrs)
        if nh % ng:
            fail(f"num_heads={nh} is not a multiple of num_kv_heads={ng}")
        want = [nh * d, ng * d, ng * dv]
        for name, shape, n in zip("qkv", shapes, want):
            if shape[-1] != n:
                fail(f"{name} has last dim {shape[-1]}, expected {n} heads*{'v_head_dim' if name == 'v' else 'head_dim'}")
        if shapes[1][:-1] != shapes[0][:-1] or shapes[2][:-1] != shapes[0][:-1]:
            fail("q, k and v must share their [sequence, batch] dims")
        if len(shapes) == 4 and tuple(shapes[3]) != (shapes[0][1], shapes[0][0]):
            fail(f"document ids must be [batch, sequence] = {[shapes[0][1], shapes[0][0]]}, got {list(shapes[3])}")
        return [tuple(shapes[0][:-1]) + (nh * dv,)]

    def rule_tp(self, attrs, ctx):
        # document ids (a 4th input) are read whole on every rank
        return LayoutRule(allowed=("I", "S(h)"), joined_inputs=(0, 1, 2), fixed_inputs=(None, None, None, "I"))

    def rule_cp(self, attrs, ctx):
        # S(s): this rank's two load-balanced chunks of q attend to the whole sequence's k, v,
        # which the implementation brings in itself (ring of sends, or an all-gather). Document
        # ids are read whole (I): the queries' at the rank's positions, the keys' at theirs
        return LayoutRule(allowed=("S(s)",), joined_inputs=(0, 1, 2), fixed_inputs=(None, None, None, "I"))

    def cp_comm_type(self, attrs, setting: str = "auto", seq_len: int | None = None, *, cp: int = 1,
                     batch: int = 1, elt: int = 2, documents: bool = False) -> tuple:
        """(p2p | all_gather, why): the spec's pin, then the flag's, then the cost model. Both move
        the same K/V bytes; the ring overlaps them with the block computations and never holds
        the full K/V, so it wins unless K/V are small next to Q (grouped-query attention), where
        one all-gather is cheaper than N-1 latency-bound steps and the full K/V is little memory.
        A sliding window shorter than the sequence tips it back to the ring: the ring skips the
        blocks outside the window, the all-gather computes every pair. So does a long sequence:
        the all-gather keeps a mask of the rank's queries against every key for backward
        ([S/N, S] bool, per sample with document ids), which grows with S^2 while the K/V it
        gathers grow with S; past the point where the mask outweighs the gathered K/V (at 128K
        tokens over 8 ranks, 2 GiB a layer against 512 MiB) the ring is chosen."""
        pinned = attrs.get("cp_comm_type", "auto")
        if pinned != "auto":
            return pinned, "pinned by the spec"
        if setting != "auto":
            return setting, "pinned by --cp-comm-type"
        window = attrs.get("window")
        if window and (seq_len is None or window < seq_len):
            return "p2p", (f"a sliding window of {window}: the ring skips the blocks outside it, the all-gather "
                           "would compute every pair")
        kv_heads = self.kv_heads(attrs)
        if kv_heads < attrs["num_heads"]:
            if seq_len is not None and cp > 1 and (attrs["causal"] or documents):
                mask = (seq_len // cp) * seq_len * (batch if documents else 1)
                gathered = 2 * seq_len * batch * kv_heads * attrs["head_dim"] * elt
                if mask > gathered:
                    return "p2p", (f"grouped-query attention, but at {seq_len} tokens the all-gather's mask "
                                   f"({_mib(mask)} a layer) would outweigh the K/V it gathers ({_mib(gathered)})")
            return "all_gather", (f"grouped-query attention: K/V have {kv_heads} of {attrs['num_heads']} "
                                  "heads, one all-gather beats a ring of small steps")
        return "p2p", "ring attention overlaps the K/V exchange with the block computations"

    def choices(self, attrs, settings, shapes=()):
        if settings.cp == 1:
            return {}
        q = shapes[0] if shapes else None
        kind, why = self.cp_comm_type(attrs, settings.cp_comm_type, q[0] if q else None, cp=settings.cp,
                                      batch=q[1] if q and len(q) > 1 else 1, elt=DTYPE_BYTES[settings.dtype],
                                      documents=len(shapes) == 4)
        return {"cp_comm_type_resolved": kind, "cp_comm_reason": why, "cp_size": settings.cp}

    def collectives(self, node, shapes_on, elt, mesh):
        n = mesh.size("cp")
        if n == 1 or node.in_layouts[0]["cp"] != "S(s)":
            return [], []
        _, k, v = shapes_on("cp")[:3]  # local over tp (heads), full sequence
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

    def comm_axis(self, node, collective):
        return "cp"  # K/V over the context-parallel group (the ring's sends, or the all-gather)

    def comm_hidden(self, node):
        # runtime/context_parallel.py: each ring step's send runs beside the current block's
        # computation, forward and backward; the all-gather comes before the computation
        ring = node.attrs.get("cp_comm_type_resolved", "p2p") == "p2p"
        return (1.0, 1.0) if ring else (0.0, 0.0)

    def memory_traffic(self, node, local_in, local_out, elt):
        """A fused kernel (flash, TE, SDPA's) keeps the s x s scores on chip: its memory traffic is
        q, k, v and the output, small next to its GEMMs, counted as none. The unfused path (and
        soft-capping, which takes it) writes the scores to memory and passes over them: forward
        QK^T writes them, softmax reads and writes them, PV reads them (4 passes); backward
        the probabilities' gradient is written, read with the probabilities by softmax's backward
        and its output written and read by the two GEMMs (6 passes); dropout on the probabilities
        adds a read, a write and its one-byte mask each way. Under CP see _cp_block_traffic."""
        a = node.attrs
        if node.in_layouts and node.in_layouts[0]["cp"] == "S(s)":
            return self._cp_block_traffic(node, local_in)
        if node.impl != "unfused" and not a.get("softcap"):
            return 0, 0
        q, k = local_in[0], local_in[1]
        heads = q[-1] // a["head_dim"]
        scores = q[1] * heads * q[0] * k[0]
        drop = (2 * elt + 1) * scores if a["dropout"] > 0 else 0
        capped = 2 * elt * scores if a.get("softcap") else 0
        return 4 * elt * scores + drop + capped, 6 * elt * scores + drop + capped

    def flops(self, node, local_in, local_out, mesh):
        """Q K^T and the probabilities times V: 2 * b * pairs * heads * (head_dim + v_head_dim) forward, over
        the (query, key) pairs the implementation computes; backward 2x (dQ, dK from the scores'
        gradient; dV, dP from the output's). Which pairs:

        * a fused kernel on the plain causal mask (SDPA's is_causal, flash, TE) skips the tiles
          above the diagonal: s^2/2 (Megatron's convention; the diagonal tiles it computes in
          full are not counted); bidirectional: s^2;
        * an explicit mask (a window or document ids at CP = 1: SDPA with attn_mask), soft-capped
          scores or the unfused path compute every pair and mask after: s^2;
        * under CP, cp_pairs(): the ring (p2p) computes the chunk pairs its mask does not rule
          out (a window much shorter than the chunks keeps about two of the 2N key chunks per
          query chunk), the all-gather its whole s_q x S rectangle. Document ids never skip a
          block (they are data)."""
        q = local_in[0]
        s_q, b = q[0], q[1]
        heads = q[-1] // node.attrs["head_dim"]
        cp = mesh.size("cp") if node.in_layouts and node.in_layouts[0]["cp"] == "S(s)" else 1
        a = node.attrs
        if cp > 1:
            pairs = cp_pairs(s_q, cp, a.get("cp_comm_type_resolved", "p2p"), a["causal"], a.get("window"))
        else:
            explicit = (node.impl == "unfused" or a.get("softcap") or a.get("window") or a.get("chunk")
                        or a["alibi"] or len(local_in) == 4)
            pairs = s_q * s_q // (2 if a["causal"] and not explicit else 1)
        forward = 2 * b * pairs * heads * (node.attrs["head_dim"] + self.v_dim(node.attrs))  # QK^T, then PV
        return forward, 2 * forward

    def kernel_flops(self, node, local_in, local_out, mesh):
        """Under CP, what runtime/context_parallel.py's blocks compute: every pair of its blocks
        (cp_computed_pairs: the ring's diagonal chunk pairs whole, masked pairs included), and backward
        recomputes the scores (Q K^T) from the saved log-sum-exp before its four products:
        forward 2 * b * pairs * heads * (head_dim + v_head_dim), backward twice that plus
        2 * b * pairs * heads * head_dim. None elsewhere: a fused kernel's rate is calibrated on
        flops() (efficiency.attention), so its own masked tiles and recompute are in that rate."""
        if not (node.in_layouts and node.in_layouts[0]["cp"] == "S(s)"):
            return None
        pairs, b, heads = self._cp_computed(node, local_in)
        return cp_block_flops(b * heads * pairs, node.attrs["head_dim"], self.v_dim(node.attrs))

    def _cp_computed(self, node, local_in) -> tuple:
        """(pairs computed per (batch, head), batch, local heads) of the runtime's CP blocks."""
        a, q = node.attrs, local_in[0]
        by_position = bool(a.get("window") or a.get("chunk") or a["alibi"] or len(local_in) == 4)
        pairs = cp_computed_pairs(q[0], a["cp_size"], a.get("cp_comm_type_resolved", "p2p"), a["causal"],
                                  a.get("window"), by_position)
        return pairs, q[1], q[-1] // a["head_dim"]

    def matmul_kernel(self, node):
        # sdpa, flash and TE are fused kernels, whose rate a profile states apart
        # (efficiency.attention); the unfused path (soft-capping takes it) and CP's blocks
        # (runtime/context_parallel.py, torch.matmul over each block) run batched per-head GEMMs
        # (efficiency.batched_gemm), CP's as "cp_blocks", whose passes over the scores a profile
        # may rate apart (efficiency.cp_blocks)
        if node.in_layouts and node.in_layouts[0]["cp"] == "S(s)":
            return "cp_blocks"
        unfused = node.impl == "unfused" or node.attrs.get("softcap")
        return "batched_gemm" if unfused else "attention"

    def _cp_block_traffic(self, node, local_in) -> tuple:
        """runtime/context_parallel.py computes each block of scores in memory, in fp32 at least
        (flash attention's algorithm, not its fused kernel), forward and backward alike, over
        the pairs flops() counts. Passes over a block's scores, c bytes each: forward the QK^T
        write, the scaling's read and write, logsumexp's two reads, subtracting the lse and the
        exponential (a read and a write each), PV's read: 10; backward recomputes the scores
        (1 + 2 + 2 + 2), writes dP (1), reads P for dV (1), dS = P (dP - delta) scale (2 + 3 + 2)
        and reads dS for dQ and dK (2): 18. Dropout adds its mask and two products forward
        (4c + 1), the mask's scaled copy and two products backward (7c + 1); soft-capping its
        division, tanh and product forward (6c) and again with its derivative backward (11c).
        Over the pairs the blocks compute (cp_computed_pairs, masked ones included); the mask's
        own pass on a masked block is left out."""
        a = node.attrs
        pairs, b, heads = self._cp_computed(node, local_in)
        fwd, bwd = cp_block_pass_bytes(a["dropout"] > 0, bool(a.get("softcap")))
        return fwd * b * heads * pairs, bwd * b * heads * pairs

    def saved_bytes(self, node, local_in, local_out, elt):
        if node.in_layouts and node.in_layouts[0]["cp"] == "S(s)":
            return self._cp_saved_bytes(node, local_in, local_out, elt)
        q, k, v = local_in[:3]
        s, b = q[0], q[1]
        heads = q[-1] // node.attrs["head_dim"]
        saved = [(node.inputs[0], numel(q) * elt), (node.inputs[1], numel(k) * elt), (node.inputs[2], numel(v) * elt)]
        a = node.attrs
        if a["alibi"]:  # a float mask: the bias, -inf where masked, [b (documents) or 1, heads, s, s]
            saved.append((node.id + ":attn_mask", (b if len(local_in) == 4 else 1) * heads * s * s * elt))
        elif len(local_in) == 4:  # the per-batch document mask [b, 1, s, s] (bool), kept for backward
            saved.append((node.id + ":attn_mask", b * s * s))
        elif a.get("window") or a.get("chunk"):  # one window (chunk) mask for the batch
            saved.append((node.id + ":attn_mask", s * s))
        if node.impl == "unfused" or a.get("softcap"):  # soft-capping runs the unfused path
            scores = heads * s * s * b
            saved.append((node.id + ":softmax", scores * elt))
            if a.get("softcap"):  # tanh's backward reads its output: the capped scores
                saved.append((node.id + ":capped", scores * elt))
            if node.attrs["dropout"] > 0:
                saved += [(node.id + ":mask", scores), (node.id + ":dropout", scores * elt)]
        if node.impl != "unfused" and not a.get("softcap"):
            # fused kernels keep the output and the row log-sum-exp, never the s x s scores
            saved += [(node.outputs[0], numel(local_out[0]) * elt), (node.id + ":lse", heads * s * b * 4)]
        return saved

    def _cp_saved_bytes(self, node, local_in, local_out, elt):
        """runtime.context_parallel keeps what flash attention keeps, whatever the backend and
        the masks (backward recomputes each block's scores, their soft-cap and the ring's block
        masks): q, the output and the fp32 log-sum-exp; with the ring this rank's k and v, with
        the all-gather the gathered K and V and its one mask of the rank's queries against every
        key, [s_q, S] bool ([b, s_q, S] with document ids). Dropout masks are drawn again."""
        q, k, v = local_in[:3]
        s, b = q[0], q[1]
        heads = q[-1] // node.attrs["head_dim"]
        a = node.attrs
        saved = [(node.inputs[0], numel(q) * elt), (node.outputs[0], numel(local_out[0]) * elt),
                 (node.id + ":lse", heads * s * b * 4)]
        if a.get("cp_comm_type_resolved", "p2p") != "all_gather":
            return saved + [(node.inputs[1], numel(k) * elt), (node.inputs[2], numel(v) * elt)]
        n = a["cp_size"]
        saved += [(node.id + ":k_all", numel(k) * n * elt), (node.id + ":v_all", numel(v) * n * elt)]
        if len(local_in) == 4:
            saved.append((node.id + ":attn_mask", b * s * s * n))
        elif a["causal"] or a.get("window") or a.get("chunk"):
            saved.append((node.id + ":attn_mask", s * s * n))
        if a["alibi"]:  # the bias of the rank's queries against every key, in the (fp32) compute dtype
            saved.append((node.id + ":alibi", heads * s * s * n * max(elt, 4)))
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
        for key in ("window", "scale", "softcap", "v_head_dim"):
            if a.get(key) and (key != "v_head_dim" or a[key] != a["head_dim"]):
                extra += f", {key}={a[key]!r}"
        if a.get("chunk"):
            extra += f", chunk={a['chunk']}"
        if a["alibi"]:  # slopes by global head index: the rank's first head from the TP group
            extra += f", alibi_max_bias={a['alibi_max_bias']!r}" + (", tp=self.tp" if t > 1 and "tp=" not in extra else "")
        return (f"runtime.CoreAttention({a['num_heads'] // t}, {self.local_kv_heads(a, t)}, {a['head_dim']}, "
                f"causal={a['causal']}, dropout={a['dropout']!r}, backend=\"{backend}\", rng_tracker=rng_tracker"
                + extra + ")")

    def call(self, node, args, ctx):
        return f"self.{node.attr_name}({', '.join(args)})"


def _chunk_pair_kind(q_start: int, k_start: int, c: int, causal: bool, window) -> str:
    """skip | full | partial: what the causal mask and/or a window (i - W < j <= i causal,
    |i - j| < W bidirectional) keep of queries [q_start, q_start + c) against keys
    [k_start, k_start + c). runtime.context_parallel.chunk_pair_kind decides the ring's blocks
    by the same rule (tests/runtime/test_context_parallel.py checks they agree)."""
    lo, hi = q_start - (k_start + c - 1), q_start + c - 1 - k_start  # the least and largest i - j
    if causal:
        if hi < 0:
            return "skip"
        nearest, farthest, full = max(lo, 0), hi, lo >= 0
    else:
        nearest = 0 if lo <= 0 <= hi else min(abs(lo), abs(hi))
        farthest, full = max(abs(lo), abs(hi)), True
    if window is not None:
        if nearest >= window:
            return "skip"
        full = full and farthest < window
    return "full" if full else "partial"


def cp_pairs(s_local: int, n: int, comm_type: str, causal: bool, window) -> int:
    """The (query, key) pairs one CP rank's attention computes, its queries being s_local of the
    S = n * s_local tokens. The all-gather: s_local * S, masked pairs included. The ring: every
    chunk pair (c = s_local / 2 tokens each side) its mask does not rule out, in full, but a
    causal diagonal pair counted c^2/2 as the fused kernels' diagonal is (Megatron's s^2/2), so
    the plain causal ring counts s_local * S / 2 and a window as long as the sequence the same;
    averaged over the ranks (their counts differ by a few chunk pairs under a window)."""
    if comm_type == "all_gather":
        return s_local * s_local * n
    c = s_local // 2
    halves = 0  # in units of c^2 / 2
    for rank in range(n):
        for src in range(n):
            for q_start in (k * c for k in cp_chunk_pair(n, rank)):
                for k_start in (k * c for k in cp_chunk_pair(n, src)):
                    if _chunk_pair_kind(q_start, k_start, c, causal, window) != "skip":
                        halves += 1 if causal and q_start == k_start else 2
    return halves * c * c // (2 * n)


def cp_block_flops(scores: int, head_dim: int, v_head_dim: int) -> tuple:
    """(forward, backward) FLOPs runtime/context_parallel.py's blocks run over `scores` (batch x
    heads x pairs computed): Q K^T and P V forward; backward recomputes Q K^T, then dP, dV, dQ, dK."""
    forward = 2 * scores * (head_dim + v_head_dim)
    return forward, 2 * forward + 2 * scores * head_dim


def cp_block_pass_bytes(dropout: bool, softcap: bool) -> tuple:
    """(forward, backward) bytes the CP blocks' memory-bound passes move per score computed
    (OpKind memory_traffic of core_attention under CP, which says which passes)."""
    c = 4  # promote_types(dtype, float32)
    fwd, bwd = 10 * c, 18 * c
    if dropout:
        fwd, bwd = fwd + 4 * c + 1, bwd + 7 * c + 1
    if softcap:
        fwd, bwd = fwd + 6 * c, bwd + 11 * c
    return fwd, bwd


def cp_computed_pairs(s_local: int, n: int, comm_type: str, causal: bool, window, by_position: bool) -> int:
    """The (query, key) pairs runtime/context_parallel.py's blocks compute on one CP rank, masked
    ones included (cp_pairs counts those the mask keeps). The all-gather: s_local * S. The ring
    with the plain causal mask: its first step is the local block but the pair of its first
    query chunk and second key chunk (all masked), 3c^2 (c = s_local / 2), the two diagonal chunk
    pairs whole; each later step half a block, 2c^2. Bidirectional: a whole block, 4c^2, a step.
    Under a mask by position (`by_position`: a window, chunks, ALiBi's bias or document ids)
    every chunk pair the causal mask and the window do not rule out, c^2 each (rows of one query
    chunk against the key chunks it keeps). Averaged over the ranks."""
    if comm_type == "all_gather":
        return s_local * s_local * n
    c = s_local // 2
    if not by_position:
        return (3 + (n - 1) * 2) * c * c if causal else 4 * n * c * c
    kept = sum(_chunk_pair_kind(q_start, k_start, c, causal, window) != "skip"
               for rank in range(n) for src in range(n)
               for q_start in (k * c for k in cp_chunk_pair(n, rank))
               for k_start in (k * c for k in cp_chunk_pair(n, src)))
    return kept * c * c // n


def _mib(nbytes: int) -> str:
    return f"{nbytes / 2 ** 20:,.0f} MiB"
