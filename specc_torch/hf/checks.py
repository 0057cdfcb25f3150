"""What import checks of config.json against the spec before it reads a tensor: the values the
mapping pins (check_config), the behaviour each op models (check_modeled, through the ops' HFKnobs)
and the kind of every layer (check_layer_kinds)."""

from __future__ import annotations

import json

from .files import HFError
from .mapping import Mapping


def _same_value(want, have) -> bool:
    if isinstance(want, bool) or isinstance(have, bool):
        return want is have
    if isinstance(want, (int, float)) and isinstance(have, (int, float)):
        return float(want) == float(have)
    return want == have


def check_config(mapping: Mapping, config: dict, where: str, spec_name: str) -> None:
    """Every value the mapping's `config` and `import_config` declare must equal config.json's
    (keys that config.json leaves out or sets to null are not checked)."""
    if mapping.architecture is not None and config.get("architectures"):
        if mapping.architecture not in config["architectures"]:
            raise HFError(f"{where}: the model is {', '.join(map(str, config['architectures']))}, but spec "
                          f"{spec_name} maps {mapping.architecture}")

    def walk(want: dict, have: dict, prefix: str) -> None:
        for key, value in want.items():
            got = have.get(key) if isinstance(have, dict) else None
            if got is None:
                continue
            if isinstance(value, dict) and isinstance(got, dict):
                walk(value, got, f"{prefix}{key}.")
            elif not _same_value(value, got):
                raise HFError(f"{where}: config.json has {prefix}{key} = {json.dumps(got)}, but spec {spec_name} "
                              f"gives {json.dumps(value)}")

    walk(mapping.config, config, "")
    walk(mapping.import_config, config, "")


def _same_request(want, have) -> bool:
    if want is None or have is None:
        return want is None and have is None
    if isinstance(want, bool) or isinstance(have, bool):
        return bool(want) is bool(have) if isinstance(want, bool) and isinstance(have, bool) else False
    if isinstance(want, (int, float)) and isinstance(have, (int, float)):
        return abs(float(want) - float(have)) <= 1e-9 * max(abs(float(want)), abs(float(have)))
    return want == have


def _shown(value) -> str:
    return "none" if value is None else json.dumps(value)


def check_modeled(graph, config: dict, where: str, spec_name: str) -> None:
    """Refuse a checkpoint whose config.json asks for behaviour the spec's ops do not model: every
    op kind declares the Hugging Face keys it knows (HFKnob: sliding_window, rope scaling, the
    partial rotary factor, soft-capping, tied embeddings...), and each is compared with what the
    model's ops of that kind do, op by op, so nothing depends on a spec author listing the key."""
    from specc.ops import OPS

    for kind in OPS.values():
        knobs = kind.hf_knobs()
        if not knobs:
            continue
        ops = [op for op in graph.iter_ops() if op.kind == kind.name]
        for knob in knobs:
            want = knob.requested(config, len(ops))
            if want is None:
                continue
            if knob.any:
                (asked,) = want
                for have in [v for v in (knob.modeled(op.attrs) for op in ops) if v] or [knob.absent]:
                    if not _same_request(asked, have):
                        raise HFError(f"{where}: config.json asks for {knob.key} = {_shown(asked)}, but spec {spec_name}'s "
                                      f"{kind.name} ops model {_shown(have)}")
                continue
            for op, asked in zip(ops, want):
                have = knob.modeled(op.attrs)
                if not _same_request(asked, have):
                    raise HFError(f"{where}: config.json asks for {knob.key} = {_shown(asked)}, but spec {spec_name} "
                                  f"models {_shown(have)} at {op.id} ({kind.name})")


def layer_kinds(mapping: Mapping, graph, spec_name: str) -> list:
    """The kind config.json gives each layer of the repeated block (hf.layer_types), by the module
    the spec builds it from: [] when the mapping declares none."""
    if mapping.layer_types is None:
        return []
    key, names = mapping.layer_types
    blocks = [scope for scope in graph.repeats if "." not in scope]
    if len(blocks) != 1:
        raise HFError(f"spec {spec_name}: hf.layer_types names the kinds of one repeated block, but the model has "
                      f"{len(blocks)}")
    modules = [graph.scopes[f"{blocks[0]}.{i}"] for i in range(graph.repeats[blocks[0]])]
    missing = sorted(set(modules) - set(names))
    if missing:
        raise HFError(f"spec {spec_name}: hf.layer_types.names has no kind for module {missing[0]}")
    return [names[m] for m in modules]


def check_layer_kinds(mapping: Mapping, graph, config: dict, where: str, spec_name: str) -> None:
    """config.json's list of layer kinds (when it has one) must be the spec's, layer by layer."""
    kinds = layer_kinds(mapping, graph, spec_name)
    have = config.get(mapping.layer_types[0]) if kinds else None
    if have is None:
        return
    if have != kinds:
        at = next((i for i, (a, b) in enumerate(zip(have, kinds)) if a != b), min(len(have), len(kinds)))
        got = f"{have[at]!r}" if isinstance(have, list) and at < len(have) else "nothing"
        raise HFError(f"{where}: config.json's {mapping.layer_types[0]} has {len(have) if isinstance(have, list) else have} "
                      f"layers and {got} at layer {at}, but spec {spec_name} builds "
                      f"{kinds[at] if at < len(kinds) else 'nothing'} there ({len(kinds)} layers)")
