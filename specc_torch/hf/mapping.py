"""The Hugging Face mapping a spec declares under `hf:` (format: docs/checkpoints.md), bound to
the parameters of the compiled model.

    hf:
      architecture: LlamaForCausalLM
      config: {num_attention_heads: "${num_attention_heads}", ...}   # written on export, checked on import
      export_config: {max_position_embeddings: "${seq_length}"}      # written on export only
      import_config: {rope_theta: "${rotary_base}"}                  # checked on import only
      import_defaults: {layer_types: [sliding_attention, full_attention]}  # what transformers assumes where config.json is silent
      rotary: {layout: rotate_half}                                  # HF's q/k row order (or interleaved)
      params:
        - {specc: embedding.weight, hf: model.embed_tokens.weight}
        - specc: "layers.{i}.self_attention.linear_qkv.weight"      # {i}: the layer index
          hf: ["model.layers.{i}.self_attn.q_proj.weight", ...]      # one per segment: split / joined
          rotary: [true, true, false]                                # pieces holding rotary heads
        - {specc: "layers.{i}.mlp.linear_fc1.weight", hf: "transformer.h.{i}.mlp.c_fc.weight", transpose: true}
        - specc: "layers.{i}.mlp.experts.linear_fc1.weight"          # stacked experts [E, 2F, h]
          hf: ["model.layers.{i}.mlp.experts.{e}.w1.weight", ...]    # {e}: one tensor per expert, stacked
        - specc: "layers.{i}.self_attention.linear_qkv.weight"      # HF rows: per head [q_h | k_h | v_h]
          hf: "gpt_neox.layers.{i}.attention.query_key_value.weight"
          permute: {groups: "${num_attention_heads}", sections: ["${head_dim}", "${head_dim}", "${head_dim}"]}
      ignore: ["lm_head.weight"]                                     # HF tensors that are not imported
      layer_types: {key: layers_block_type, names: {MambaLayer: mamba, AttentionLayer: attention}}  # per layer, by module

Nothing here knows a model family: which names, which transposes, which splits all come from the
spec. The structure was checked when the spec was loaded (specc/frontend/load.py, _check_hf).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from specc.errors import Loc, SpecError, did_you_mean
from specc.frontend.expr import has_interpolation, interpolate, unknown_name


@dataclass
class Entry:
    specc: str  # a name pattern; {i} is a layer index
    hf: list  # name patterns, one per segment when `fused`
    fused: bool  # hf was a list: the specc parameter's segments are split into (joined from) them
    transpose: bool
    rotary: list  # per hf name: holds rotary q/k heads
    loc: Loc
    experts: bool = False  # hf names hold {e}: one tensor per expert, stacked on the parameter's dim 0
    permute: tuple | None = None  # (groups, sections): HF rows are groups of [s0 | s1 | ...]

    def regex(self) -> re.Pattern:
        return re.compile(re.escape(self.specc).replace(re.escape("{i}"), r"(?P<i>\d+)") + "$")


@dataclass
class Mapping:
    architecture: str | None
    config: dict  # evaluated against the spec's config
    export_config: dict
    import_config: dict
    import_defaults: dict  # config.json keys older files leave out, as transformers fills them in
    rotary_layout: str  # "rotate_half" | "interleaved"
    rotary_head_dim: int | None
    entries: list = field(default_factory=list)
    ignore: list = field(default_factory=list)  # name patterns
    loc: Loc | None = None
    # features of each head that rotate, read from the spec's rotary ops (convert.with_rotary):
    # the interleaved permutation covers those only (GPT-J rotates 64 of 256)
    rotary_dim: int | None = None
    # (config.json key, {spec module: its layer kind there}): the kinds of the repeated block's layers
    layer_types: tuple | None = None


def _plain(value):
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    if isinstance(value, str):
        return str(value)
    return value


def _evaluate(raw, loc: Loc, spec):
    def lookup(name, at):
        if name in spec.config:
            return spec.config[name]
        raise unknown_name(name, at, list(spec.config))

    if isinstance(raw, dict):
        return {str(k): _evaluate(v, raw.value_loc(k) if hasattr(raw, "value_loc") else loc, spec)
                for k, v in raw.items()}
    if isinstance(raw, list):
        return [_evaluate(v, raw.item_loc(i) if hasattr(raw, "item_loc") else loc, spec) for i, v in enumerate(raw)]
    if isinstance(raw, str) and has_interpolation(raw):
        start = raw.loc_at(0) if hasattr(raw, "loc_at") else loc
        return _plain(interpolate(raw, start, lookup))
    return _plain(raw)


def mapping_of(spec) -> Mapping:
    """The spec's `hf:` mapping, evaluated; a SpecError when the spec has none."""
    hf = spec.hf
    where = Loc(spec.path)
    if not hf or not hf.get("params"):
        raise SpecError(where, f"spec {spec.name} declares no Hugging Face mapping ('hf:' with 'params')",
                        "see docs/checkpoints.md for the format; specs/gpt.yaml and specs/llama.yaml have one")
    loc = getattr(hf, "loc", where)
    rotary = hf.get("rotary") or {}
    entries = []
    params = hf["params"]
    for n, raw in enumerate(params):
        names = raw["hf"]
        fused = isinstance(names, list)
        names = [str(x) for x in names] if fused else [str(names)]
        flags = raw.get("rotary", False)
        flags = list(flags) if isinstance(flags, list) else [bool(flags)] * len(names)
        permute = None
        if raw.get("permute") is not None:
            at = raw.value_loc("permute") if hasattr(raw, "value_loc") else loc
            p = _evaluate(raw["permute"], at, spec)
            permute = (int(p["groups"]), tuple(int(x) for x in p["sections"]))
        entries.append(Entry(str(raw["specc"]), names, fused, bool(raw.get("transpose", False)), flags,
                             raw.value_loc("specc") if hasattr(raw, "value_loc") else loc,
                             experts=any("{e}" in n for n in names), permute=permute))
    return Mapping(
        architecture=str(hf["architecture"]) if hf.get("architecture") is not None else None,
        config=_evaluate(hf.get("config") or {}, loc, spec),
        export_config=_evaluate(hf.get("export_config") or {}, loc, spec),
        import_config=_evaluate(hf.get("import_config") or {}, loc, spec),
        import_defaults=_evaluate(hf.get("import_defaults") or {}, loc, spec),
        rotary_layout=str(rotary.get("layout", "rotate_half")),
        rotary_head_dim=_evaluate(rotary["head_dim"], loc, spec) if "head_dim" in rotary else None,
        entries=entries,
        ignore=[str(x) for x in hf.get("ignore") or []],
        loc=loc,
        layer_types=(str(hf["layer_types"]["key"]), {str(k): str(v) for k, v in hf["layer_types"]["names"].items()})
        if hf.get("layer_types") else None,
    )


def bind(mapping: Mapping, names, spec_name: str) -> dict:
    """{specc parameter name: (entry, [hf names])} for every parameter of the model; every
    parameter mapped exactly once, every entry used."""
    names = list(names)
    bound, used = {}, set()
    for entry in mapping.entries:
        regex = entry.regex()
        for name in names:
            m = regex.match(name)
            if not m:
                continue
            if name in bound:
                raise SpecError(entry.loc, f"parameter '{name}' is mapped by both '{bound[name][0].specc}' and "
                                f"'{entry.specc}'")
            index = m.groupdict().get("i")
            bound[name] = (entry, [h.replace("{i}", index) if index is not None else h for h in entry.hf])
            used.add(id(entry))
    for entry in mapping.entries:
        if id(entry) not in used:
            guess = entry.specc.replace("{i}", "0")
            raise SpecError(entry.loc, f"'{entry.specc}' matches no parameter of model {spec_name}",
                            did_you_mean(guess, names) or "is this mapping meant for this spec?")
    missing = [n for n in names if n not in bound]
    if missing:
        raise SpecError(mapping.loc, f"the hf mapping has no entry for parameter '{missing[0]}'"
                        + (f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""),
                        "add - {specc: NAME, hf: HF_NAME} to hf.params")
    return bound


def expert_names(entry: Entry, hf_names: list, count: int) -> list:
    """[[hf names of expert j] for j in range(count)] of an entry with {e}; [hf_names] without."""
    if not entry.experts:
        return [hf_names]
    return [[h.replace("{e}", str(j)) for h in hf_names] for j in range(count)]


def ignored(mapping: Mapping, hf_name: str) -> bool:
    for pattern in mapping.ignore:
        regex = re.escape(pattern).replace(re.escape("{i}"), r"\d+") + "$"
        if re.match(regex, hf_name):
            return True
    return False
