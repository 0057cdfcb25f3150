"""Rotary position embedding: the op, and the Hugging Face rope settings it models (transformers'
rope_parameters, older rope_scaling, per layer type), with YaRN's and LongRoPE's derivations in
rope_scaling.py; and Llama 4's attention temperature tuning, the position-dependent query scale of
its layers without rope."""

from __future__ import annotations

from ..errors import SpecError
from . import rope_scaling
from .base import Attr, HFKnob, LayoutRule, OpKind


def _rope(config: dict) -> dict:
    """Hugging Face's rotary settings, whichever way the config spells them: transformers 5's
    rope_parameters, older rope_scaling (type or rope_type) beside rope_theta, GPT-NeoX's rotary_pct."""
    out = {}
    for key, new in (("rope_theta", "rope_theta"), ("partial_rotary_factor", "partial_rotary_factor"),
                     ("rotary_pct", "partial_rotary_factor"), ("rotary_emb_base", "rope_theta")):
        if config.get(key) is not None:
            out[new] = config[key]
    for block in ("rope_scaling", "rope_parameters"):
        params = config.get(block)
        if isinstance(params, dict):
            out.update({k: v for k, v in params.items() if v is not None})
            if "type" in params and "rope_type" not in params:
                out["rope_type"] = params["type"]
    return out


def _rope_layers(config: dict, n: int) -> list:
    """Hugging Face's rotary settings for each of the model's n rotary ops: one set for all, or
    (Gemma 3, transformers 5) rope_parameters keyed by layer type, picked per layer by
    layer_types (cycled, as _windows does). A layer calls its rotary for q and for k: with
    num_hidden_layers dividing n, op i is in layer i // (n / layers). Keyed settings without
    layer_types to pick them by ask for the keyed dict itself, which no op models."""
    params = config.get("rope_parameters")
    if isinstance(params, dict) and params and all(isinstance(v, dict) for v in params.values()):
        types = config.get("layer_types")
        if not (isinstance(types, list) and types):
            return [{"rope_theta": params, "rope_type": params}] * n
        layers = config.get("num_hidden_layers")
        per_layer = n // layers if isinstance(layers, int) and layers > 0 and n % layers == 0 else 1
        out = []
        for i in range(n):
            kind = types[(i // per_layer) % len(types)]
            per_type = params.get(kind) if isinstance(kind, str) else None
            if per_type is None:  # a layer type with no settings: asked for by name
                out.append({"rope_theta": f"no rope_parameters for {kind}", "rope_type": kind})
                continue
            out.append(_rope({**{k: v for k, v in config.items() if k != "rope_parameters"},
                              "rope_parameters": per_type}))
        return out
    return [_rope(config)] * n


def _rope_key(key: str, scalings: tuple = ()):
    """requested(): a rotary setting per op; one that belongs to some scalings only (a factor) is
    asked for on the layers whose rope_type is one of them, and none elsewhere (the op's
    `modeled` says none when it does not scale that way)."""
    def requested(config, n):
        ropes = _rope_layers(config, n)
        applies = [not scalings or rope.get("rope_type") in scalings for rope in ropes]
        if not any(key in rope and ok for rope, ok in zip(ropes, applies)):
            return None
        return [rope.get(key) if ok else None for rope, ok in zip(ropes, applies)]
    return requested


def _rope_derived(read, scalings: tuple):
    """requested(): read(rope settings, config) for each op whose rope_type is one of `scalings`,
    none for the others; None when no op's is (rope_scaling reads them as transformers does)."""
    def requested(config, n):
        ropes = _rope_layers(config, n)
        if not any(rope.get("rope_type") in scalings for rope in ropes):
            return None
        return [read(rope, config) if rope.get("rope_type") in scalings else None for rope in ropes]
    return requested


_ORIGINAL = ("llama3", "yarn", "longrope")  # the rope types with a pre-training context


class Rotary(OpKind):
    name = "rotary"
    doc = ("Rotary position embedding over [s, b, heads*head_dim]: on the first rotary_dim features of each head, "
           "rotate-half or interleaved pairs, with optional linear, Llama 3, YaRN or LongRoPE frequency scaling. "
           "An optional 2nd input, position ids [b, s], gives each token's position (packed documents); "
           "default 0..s-1.")
    attrs = (
        Attr("head_dim", "int", required=True, minimum=2),
        Attr("base", "float", default=10000.0, minimum=1.0),
        Attr("rotary_dim", "int", minimum=2, doc="features of each head that rotate (GPT-NeoX, Phi); default all"),
        Attr("interleaved", "bool", default=False, doc="pairs (2i, 2i+1) as GPT-J; default rotate-half (i, i + d/2)"),
        Attr("scaling", "str", default="none", choices=("none", "linear", "llama3", "yarn", "longrope"),
             doc="frequency scaling: linear divides every frequency by factor; llama3 as Llama 3.1; yarn and "
             "longrope as transformers computes them (cos and sin also times an attention factor)"),
        Attr("factor", "float", default=1.0, minimum=1.0, doc="scaling factor (linear, llama3, yarn; longrope: the "
             "context extension, for its attention factor)"),
        Attr("low_freq_factor", "float", default=1.0, minimum=0.0, doc="llama3"),
        Attr("high_freq_factor", "float", default=4.0, minimum=0.0, doc="llama3"),
        Attr("original_max_positions", "int", default=8192, minimum=1, doc="llama3, yarn, longrope: the pre-training context"),
        Attr("beta_fast", "float", default=32.0, minimum=0.0, doc="yarn: frequencies above this many rotations keep their value"),
        Attr("beta_slow", "float", default=1.0, minimum=0.0, doc="yarn: below this many, divided by factor (a ramp between)"),
        Attr("truncate", "bool", default=True, doc="yarn: the ramp's ends rounded to whole features"),
        Attr("attention_factor", "float", minimum=0.0, doc="yarn, longrope: cos and sin times this; default derived from "
             "factor (yarn: 0.1 ln(factor) + 1; longrope: sqrt(1 + ln(factor) / ln(original_max_positions)))"),
        Attr("mscale", "float", minimum=0.0, doc="yarn (DeepSeek): attention factor mscale(factor, mscale) / "
             "mscale(factor, mscale_all_dim)"),
        Attr("mscale_all_dim", "float", minimum=0.0, doc="yarn (DeepSeek): see mscale"),
        Attr("short_factor", "float_list", doc="longrope: each frequency's divisor, sequences up to original_max_positions"),
        Attr("long_factor", "float_list", doc="longrope: each frequency's divisor, longer sequences"),
    )
    nonlinear = True  # position-dependent: needs the whole sequence on each rank
    n_inputs = (1, 2)
    packed_input = "position_ids"

    def rotary_dim(self, attrs) -> int:
        return attrs.get("rotary_dim") or attrs["head_dim"]

    def check(self, attrs, locs, ctx):
        r, d = self.rotary_dim(attrs), attrs["head_dim"]
        if r % 2 or r > d:
            raise SpecError(locs.get("rotary_dim", locs.get("head_dim")),
                            f"rotary_dim={r} must be even and at most head_dim={d}")
        # equal factors: a step, no smoothing between (Llama 4 Scout's 1.0 and 1.0)
        if attrs["scaling"] == "llama3" and attrs["high_freq_factor"] < attrs["low_freq_factor"]:
            raise SpecError(locs.get("high_freq_factor", locs.get("scaling")),
                            f"llama3 scaling needs high_freq_factor >= low_freq_factor, got "
                            f"{attrs['high_freq_factor']} and {attrs['low_freq_factor']}")
        if attrs["scaling"] == "longrope":
            for key in ("short_factor", "long_factor"):
                if len(attrs.get(key) or ()) != r // 2:
                    raise SpecError(locs.get(key, locs.get("scaling")), f"longrope needs {key} of rotary_dim / 2 = {r // 2} "
                                    f"numbers (one per frequency), got {len(attrs.get(key) or ())}")

    def out_shapes(self, attrs, shapes, fail):
        if shapes[0][-1] % attrs["head_dim"] or attrs["head_dim"] % 2:
            fail(f"last dim {shapes[0][-1]} is not a whole number of even heads of head_dim={attrs['head_dim']}")
        if len(shapes) == 2 and tuple(shapes[1]) != (shapes[0][1], shapes[0][0]):
            fail(f"position ids must be [batch, sequence] = {[shapes[0][1], shapes[0][0]]}, got {list(shapes[1])}")
        return [shapes[0]]

    def saved_bytes(self, node, local_in, local_out, elt):
        return []  # linear in its input: backward needs only the (recomputed) cos/sin

    def hf_knobs(self):
        return (
            HFKnob("rope_theta", _rope_key("rope_theta"), lambda a: a["base"]),
            HFKnob("partial_rotary_factor", _rope_key("partial_rotary_factor"),
                   lambda a: self.rotary_dim(a) / a["head_dim"]),
            HFKnob("rope_type", _rope_key("rope_type"), lambda a: {"none": "default"}.get(a["scaling"], a["scaling"])),
            # DeepSeek's rope_interleave: (2i, 2i+1) pairs in the weights (transformers turns them
            # into halves as it rotates, which leaves q.k as the interleaved rotation gives it)
            HFKnob("rope_interleave", lambda config, n: [config["rope_interleave"]] * n
                   if isinstance(config.get("rope_interleave"), bool) else None, lambda a: a["interleaved"]),
            HFKnob("rope factor", _rope_derived(rope_scaling.hf_factor, rope_scaling.SCALINGS),
                   lambda a: a["factor"] if a["scaling"] in rope_scaling.SCALINGS else None),
            HFKnob("rope low_freq_factor", _rope_key("low_freq_factor", ("llama3",)),
                   lambda a: a["low_freq_factor"] if a["scaling"] == "llama3" else None),
            HFKnob("rope high_freq_factor", _rope_key("high_freq_factor", ("llama3",)),
                   lambda a: a["high_freq_factor"] if a["scaling"] == "llama3" else None),
            HFKnob("rope original_max_position_embeddings", _rope_derived(rope_scaling.hf_original, _ORIGINAL),
                   lambda a: a["original_max_positions"] if a["scaling"] in _ORIGINAL else None),
            *(HFKnob(f"rope {key}", _rope_derived(rope_scaling.hf_yarn(key, default), ("yarn",)),
                     lambda a, key=key: a[key] if a["scaling"] == "yarn" else None)
              for key, default in (("beta_fast", 32), ("beta_slow", 1), ("truncate", True))),
            *(HFKnob(f"rope {key}", _rope_derived(rope_scaling.hf_list(key), ("longrope",)),
                     lambda a, key=key: list(a[key]) if a["scaling"] == "longrope" and a.get(key) else None)
              for key in ("short_factor", "long_factor")),
            HFKnob("rope attention factor", _rope_derived(rope_scaling.hf_attention_factor, rope_scaling.EXTENDING),
                   lambda a: rope_scaling.modeled_attention_factor(a) if a["scaling"] in rope_scaling.EXTENDING else None),
        )

    def rule_tp(self, attrs, ctx):
        # position ids (a 2nd input) are read whole on every rank
        return LayoutRule(allowed=("I", "R", "S(h)"), joined_inputs=(0,), fixed_inputs=(None, "I"))

    def rule_cp(self, attrs, ctx):
        # on a CP shard the rotary module takes the positions of this rank's two chunks; position
        # ids are the whole sequence's (I), looked up at the rank's positions
        return LayoutRule(allowed=("S(s)",), joined_inputs=(0,), fixed_inputs=(None, "I"))

    def out_segments(self, attrs, in_segments):
        return in_segments[0] if in_segments else ()

    def constructor(self, node, ctx):
        a = node.attrs
        kw = ""
        if self.rotary_dim(a) != a["head_dim"]:
            kw += f", rotary_dim={self.rotary_dim(a)}"
        if a["interleaved"]:
            kw += ", interleaved=True"
        if a["scaling"] == "linear":
            kw += f', scaling="linear", factor={a["factor"]!r}'
        elif a["scaling"] == "llama3":
            kw += (f', scaling="llama3", factor={a["factor"]!r}, low_freq_factor={a["low_freq_factor"]!r}, '
                   f'high_freq_factor={a["high_freq_factor"]!r}, original_max_positions={a["original_max_positions"]}')
        elif a["scaling"] in rope_scaling.EXTENDING:  # the attention factor computed here, as transformers derives it
            kw += (f', scaling="{a["scaling"]}", factor={a["factor"]!r}, original_max_positions={a["original_max_positions"]}, '
                   f'attention_factor={rope_scaling.modeled_attention_factor(a)!r}')
            kw += (f", beta_fast={a['beta_fast']!r}, beta_slow={a['beta_slow']!r}, truncate={a['truncate']}"
                   if a["scaling"] == "yarn" else
                   f", short_factor={list(a['short_factor'])!r}, long_factor={list(a['long_factor'])!r}")
        cp = ", cp=self.cp" if node.in_layouts[0]["cp"] == "S(s)" else ""
        return f"runtime.RotaryEmbedding({a['head_dim']}, base={a['base']!r}{kw}{cp})"

    def call(self, node, args, ctx):
        return f"self.{node.attr_name}({', '.join(args)})"


def _temperature_key(key: str):
    """requested(): config.json's `key` for the model's temperature-tuned queries, one value for
    all (`any`), when config.json turns the tuning on (Llama 4's attn_temperature_tuning, which
    early files give as a number: any truthy value is on)."""
    def requested(config, n):
        if not config.get("attn_temperature_tuning") or key not in config:
            return None
        return [config[key]]
    return requested


class AttentionTemperature(OpKind):
    name = "attn_temperature"
    doc = ("Llama 4's attention temperature tuning (on its layers without rope): each query at global position p "
           "times log(floor((p + 1) / floor_scale) + 1) * attn_scale + 1, over [s, b, heads*head_dim].")
    attrs = (
        Attr("floor_scale", "float", required=True, minimum=1.0, doc="positions per step of the log (HF floor_scale)"),
        Attr("attn_scale", "float", required=True, minimum=0.0, doc="the log's weight (HF attn_scale)"),
    )
    nonlinear = True  # position-dependent, as rotary: never on a partial sum
    any_cut = True  # one factor per token, the same for every feature

    def hf_knobs(self):
        def tuning(config, n):
            flag = config.get("attn_temperature_tuning")
            return None if flag is None else [bool(flag)]

        return (
            # on or off for the model: a spec with no such op models it off
            HFKnob("attn_temperature_tuning", tuning, lambda a: True, any=True, absent=False),
            HFKnob("floor_scale", _temperature_key("floor_scale"), lambda a: a["floor_scale"], any=True),
            HFKnob("attn_scale", _temperature_key("attn_scale"), lambda a: a["attn_scale"], any=True),
        )

    def rule_tp(self, attrs, ctx):
        return LayoutRule(allowed=("I", "R", "S(h)"))  # by position: whole sequences on each rank

    def rule_cp(self, attrs, ctx):
        # on a CP shard the module takes the global positions of this rank's two chunks
        return LayoutRule(allowed=("S(s)",))

    def out_segments(self, attrs, in_segments):
        return in_segments[0] if in_segments else ()

    def saved_bytes(self, node, local_in, local_out, elt):
        return []  # linear in its input: backward needs only the per-position factors

    def constructor(self, node, ctx):
        a = node.attrs
        cp = ", cp=self.cp" if node.in_layouts[0]["cp"] == "S(s)" else ""
        return f"runtime.AttentionTemperature({a['floor_scale']!r}, {a['attn_scale']!r}{cp})"

    def call(self, node, args, ctx):
        return f"self.{node.attr_name}({args[0]})"
