"""A spec's `hf:` block, the Hugging Face mapping read by specc_torch/hf and `specc hf
import|export` (docs/checkpoints.md): its structure, checked with located errors when the spec is
loaded. Which parameters it names is checked against the compiled model when it is used."""

from __future__ import annotations

from ..errors import Loc, SpecError
from .yamlload import LDict, LList, check_keys, clip, kind_of

HF_KEYS = {"architecture", "config", "export_config", "import_config", "import_defaults", "rotary", "params", "ignore", "layer_types"}
HF_PARAM_KEYS = {"specc", "hf", "transpose", "rotary", "permute"}
HF_ROTARY_LAYOUTS = ("rotate_half", "interleaved")


def check_hf(hf, loc: Loc, value) -> None:
    """Check the structure of an `hf:` block (docs/checkpoints.md), with located errors; `value`
    evaluates ${...} in config values. Which parameters it names is checked against the compiled
    model when it is used."""
    if not isinstance(hf, LDict):
        raise SpecError(loc, f"'hf' must be a mapping, got {kind_of(hf)}", "e.g. hf: {architecture: ..., params: [...]}")
    check_keys(hf, HF_KEYS, "in 'hf'")
    if "architecture" in hf and not isinstance(hf["architecture"], str):
        raise SpecError(hf.value_loc("architecture"), f"'architecture' must be a string, got {kind_of(hf['architecture'])}",
                        "the Hugging Face class, e.g. LlamaForCausalLM")
    for key in ("config", "export_config", "import_config", "import_defaults"):
        if key in hf:
            _hf_config(hf[key], hf.value_loc(key), key, value)
    if "rotary" in hf:
        rotary = hf["rotary"]
        if not isinstance(rotary, LDict):
            raise SpecError(hf.value_loc("rotary"), f"'rotary' must be a mapping, got {kind_of(rotary)}",
                            "e.g. rotary: {layout: rotate_half}")
        check_keys(rotary, {"layout", "head_dim"}, "in 'hf.rotary'")
        layout = rotary.get("layout")
        if layout not in HF_ROTARY_LAYOUTS:
            raise SpecError(rotary.value_loc("layout") if "layout" in rotary else rotary.loc,
                            f"'rotary.layout' must be one of {', '.join(HF_ROTARY_LAYOUTS)}, got {clip(layout)!r}",
                            "how the Hugging Face q/k weights order each head's rotary pairs")
        if layout == "interleaved" or "head_dim" in rotary:
            dim = value(rotary["head_dim"], rotary.value_loc("head_dim")) if "head_dim" in rotary else None
            if isinstance(dim, bool) or not isinstance(dim, int) or dim < 2 or dim % 2:
                raise SpecError(rotary.value_loc("head_dim") if "head_dim" in rotary else rotary.loc,
                                f"'rotary.head_dim' must be an even integer, got {kind_of(dim)}", "e.g. head_dim: ${head_dim}")
    if "layer_types" in hf:
        _hf_layer_types(hf["layer_types"], hf.value_loc("layer_types"))
    if "params" in hf:
        _hf_params(hf["params"], hf.value_loc("params"), value)
    if "ignore" in hf:
        ignore = hf["ignore"]
        if not isinstance(ignore, LList):
            raise SpecError(hf.value_loc("ignore"), f"'ignore' must be a list of names, got {kind_of(ignore)}")
        for i, name in enumerate(ignore):
            _hf_name(name, ignore.item_loc(i), "an ignored name")


def _hf_layer_types(raw, loc: Loc) -> None:
    """hf.layer_types: {key: a config.json key, names: {spec module: its name there}}: the list of
    layer kinds config.json gives under `key`, one per layer of the repeated block."""
    if not isinstance(raw, LDict):
        raise SpecError(loc, f"'layer_types' must be a mapping, got {kind_of(raw)}",
                        "e.g. layer_types: {key: layer_types, names: {MambaLayer: mamba, AttentionLayer: attention}}")
    check_keys(raw, {"key", "names"}, "in 'hf.layer_types'")
    for key in ("key", "names"):
        if key not in raw:
            raise SpecError(raw.loc, f"'hf.layer_types' needs '{key}'")
    if not isinstance(raw["key"], str) or not raw["key"]:
        raise SpecError(raw.value_loc("key"), f"'layer_types.key' must be a config.json key, got {kind_of(raw['key'])}")
    names = raw["names"]
    if not isinstance(names, LDict) or not names:
        raise SpecError(raw.value_loc("names"), "'layer_types.names' must map spec modules to Hugging Face layer kinds")
    for module, kind in names.items():
        if not isinstance(kind, str):
            raise SpecError(names.value_loc(module), f"the layer kind of {module} must be a string, got {kind_of(kind)}")


def _hf_config(cfg, loc: Loc, key: str, value) -> None:
    if not isinstance(cfg, LDict):
        raise SpecError(loc, f"'{key}' must be a mapping of Hugging Face config keys, got {kind_of(cfg)}")
    for k, v in cfg.items():
        if isinstance(v, LDict):
            _hf_config(v, cfg.value_loc(k), f"{key}.{k}", value)
        else:
            value(v, cfg.value_loc(k))


def _hf_name(name, loc: Loc, what: str, experts: bool = False) -> set:
    """A parameter name pattern; its placeholders ({i}, a layer index; in hf names also {e}, an
    expert index: the per-expert tensors stacked into the specc parameter's expert dim)."""
    if not isinstance(name, str) or not name:
        raise SpecError(loc, f"{what} must be a non-empty string, got {kind_of(name)}")
    rest = name.replace("{i}", "").replace("{e}", "") if experts else name.replace("{i}", "")
    if "{" in rest or "}" in rest:
        allowed = "{i} or {e}" if experts else "{i}"
        raise SpecError(loc, f"{what} '{clip(name)}' has a placeholder other than {allowed}",
                        "{i} stands for a layer index, e.g. layers.{i}.mlp.linear_fc1.weight"
                        + ("; {e} for an expert index in hf names" if experts else ""))
    return {h for h in ("i", "e") if "{" + h + "}" in name}


def _hf_params(params, loc: Loc, value) -> None:
    if not isinstance(params, LList):
        raise SpecError(loc, f"'params' must be a list, got {kind_of(params)}",
                        "one entry per parameter: - {specc: NAME, hf: HF_NAME}")
    seen = set()
    for n, entry in enumerate(params):
        at = params.item_loc(n)
        if not isinstance(entry, LDict):
            raise SpecError(at, f"each 'params' entry must be a mapping, got {kind_of(entry)}",
                            "e.g. - {specc: embedding.weight, hf: model.embed_tokens.weight}")
        check_keys(entry, HF_PARAM_KEYS, "in an 'hf.params' entry")
        for key in ("specc", "hf"):
            if key not in entry:
                raise SpecError(at, f"'hf.params' entry is missing '{key}'",
                                "e.g. - {specc: embedding.weight, hf: model.embed_tokens.weight}")
        holes = _hf_name(entry["specc"], entry.value_loc("specc"), "the specc name")
        if entry["specc"] in seen:
            raise SpecError(entry.value_loc("specc"), f"'{clip(entry['specc'])}' is mapped twice")
        seen.add(entry["specc"])
        names = entry["hf"]
        if isinstance(names, LList):
            if not names:
                raise SpecError(entry.value_loc("hf"), "'hf' must name at least one tensor")
            items = [(x, names.item_loc(i)) for i, x in enumerate(names)]
        else:
            items = [(names, entry.value_loc("hf"))]
        expert_holes = set()
        for name, name_loc in items:
            hf_holes = _hf_name(name, name_loc, "the hf name", experts=True)
            if hf_holes - {"e"} != holes:
                raise SpecError(name_loc, f"'{clip(name)}' and '{clip(entry['specc'])}' must both have {{i}} or neither",
                                "{i} is the layer index on both sides")
            expert_holes.add("e" in hf_holes)
        if len(expert_holes) > 1:
            raise SpecError(entry.value_loc("hf"), "either every hf name of an entry has {e} or none",
                            "{e} stacks one tensor per expert into the parameter's expert dim")
        if "transpose" in entry and not isinstance(entry["transpose"], bool):
            raise SpecError(entry.value_loc("transpose"), f"'transpose' must be true or false, got {kind_of(entry['transpose'])}")
        if "rotary" in entry:
            flags = entry["rotary"]
            ok = isinstance(flags, bool) if not isinstance(names, LList) else (
                isinstance(flags, LList) and len(flags) == len(names) and all(isinstance(f, bool) for f in flags))
            if not ok:
                raise SpecError(entry.value_loc("rotary"), "'rotary' must be true/false, or a list of true/false with "
                                "one per 'hf' name", "which tensors hold rotary q/k heads")
        if "permute" in entry:
            _hf_permute(entry["permute"], entry.value_loc("permute"), value)


PERMUTE_HINT = "e.g. permute: {groups: ${num_attention_heads}, sections: [${head_dim}, ${head_dim}, ${head_dim}]}"


def _hf_permute(permute, loc: Loc, value) -> None:
    """`permute: {groups: G, sections: [a, b, ...]}`: the HF tensor's rows are G groups of
    [a | b | ...] (GPT-NeoX's per-head [q_h | k_h | v_h]); specc's are [all a | all b | ...]."""
    if not isinstance(permute, LDict):
        raise SpecError(loc, f"'permute' must be a mapping, got {kind_of(permute)}", PERMUTE_HINT)
    check_keys(permute, {"groups", "sections"}, "in 'permute'")
    for key in ("groups", "sections"):
        if key not in permute:
            raise SpecError(loc, f"'permute' is missing '{key}'", PERMUTE_HINT)
    groups = value(permute["groups"], permute.value_loc("groups"))
    if isinstance(groups, bool) or not isinstance(groups, int) or groups < 1:
        raise SpecError(permute.value_loc("groups"), f"'permute.groups' must be a positive integer, got {kind_of(groups)}",
                        PERMUTE_HINT)
    sections = value(permute["sections"], permute.value_loc("sections"))
    if not isinstance(sections, list) or not sections or any(
            isinstance(x, bool) or not isinstance(x, int) or x < 1 for x in sections):
        raise SpecError(permute.value_loc("sections"), "'permute.sections' must be a non-empty list of positive "
                        f"integers, got {clip(sections)}", PERMUTE_HINT)
