"""A spec's `megatron:` block: the Megatron-LM flags it answers to.

    megatron:
      flags:                     # --flag VALUE sets a config value (the same as --set key=VALUE)
        --num-query-groups: num_query_groups
      structure:                 # Megatron's architecture flags whose structure this spec has
        --swiglu: true           # a flag without a value
        --normalization: RMSNorm # a flag with the value that selects this spec's structure
      no_effect:                 # a flag that changes nothing in this spec's model, and why
        --max-position-embeddings: rotary positions are computed for any length

The command line (specc_cli/args.py) applies `flags` as config overrides, accepts a structural flag
the spec declares (it selects what the spec already is), accepts a `no_effect` flag with a note
in the run's log saying why and refuses any other with a hint that
names the shipped specs (specs/*.yaml) declaring it, so the compiler holds no table of
architectures: the specs say what they are.

Only model flags are the spec's to map: a flag one of specc's commands defines itself (`--lr`,
`--save`, `--tp`, `--num-layers`, ...) would be read by that command and never reach the spec, so
`plan` and `train` would build different models. The command line knows its flags
(specc_cli/args.py CommandLineFlags) and hands them to `MegatronFlags.refuse`: nothing here lists them.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from ..errors import Loc, SpecError, did_you_mean
from .yamlload import LDict, LList

MEGATRON_KEYS = ("flags", "structure", "no_effect", "checkpoint")
FLAG_SECTIONS = ("flags", "structure", "no_effect")
CHECKPOINT_KEYS = ("params", "ignore", "extra_state")
CHECKPOINT_PARAM_KEYS = ("specc", "megatron", "permute")
FLAG = re.compile(r"^--[a-z0-9][a-z0-9-]*$")


@dataclass
class MegatronFlags:
    flags: dict = field(default_factory=dict)  # flag -> config name
    structure: dict = field(default_factory=dict)  # flag -> True (no value) or the value it is given
    no_effect: dict = field(default_factory=dict)  # flag -> why it changes nothing in this spec's model
    config: set = field(default_factory=set)  # the spec's config names (for hints)
    extends: str | None = None  # the shipped spec this one extends (specs/NAME), in shipped()
    locs: dict = field(default_factory=dict)  # flag -> where the block names it (its key)

    def has_structure(self, flag: str, value: str | None) -> bool:
        declared = self.structure.get(flag)
        if declared is None or declared is False:
            return False
        if declared is True:
            return value is None
        if value is None:
            return False
        try:  # a number as Megatron reads it: --attention-dropout 0 is 0.0
            return float(value) == float(declared)
        except ValueError:
            return value.lower() == str(declared).lower()

    def refuse(self, owned) -> None:
        """The located error of the first flag of the block that is not the spec's to map:
        `owned(flag)` is (what, hint) for a flag the command line reads itself (specc_cli/args.py
        CommandLineFlags), None for a model flag. A structure declared false maps nothing."""
        if owned is None:
            return
        for flag, loc in self.locs.items():
            if self.structure.get(flag) is False:
                continue
            why = owned(flag)
            if why is not None:
                raise SpecError(loc, *why)


def check_megatron(raw, loc: Loc, config: LDict) -> MegatronFlags:
    """The block, checked: every flag looks like one and maps to a config value the spec has (or
    declares a structure). Whether the command line owns a flag is the command line's to say:
    MegatronFlags.refuse."""
    if not isinstance(raw, LDict):
        raise SpecError(loc, "'megatron' must be a mapping", "e.g. megatron: {flags: {--kv-channels: head_dim}}")
    for key in raw:
        if key not in MEGATRON_KEYS:
            raise SpecError(raw.key_loc(key), f"unknown key '{key}' in 'megatron'", did_you_mean(key, MEGATRON_KEYS))
    out = MegatronFlags()
    if "checkpoint" in raw:
        _check_checkpoint(raw["checkpoint"], raw.value_loc("checkpoint"))
    for section in FLAG_SECTIONS:
        if section not in raw:
            continue
        entries = raw[section]
        if not isinstance(entries, LDict):
            raise SpecError(raw.value_loc(section), f"'megatron.{section}' must be a mapping of Megatron flags",
                            {"structure": "e.g. --swiglu: true", "flags": "e.g. --kv-channels: head_dim"}.get(
                                section, "e.g. --max-position-embeddings: rotary positions are computed for any "
                                "length"))
        for flag, value in entries.items():
            key_loc, value_loc = entries.key_loc(flag), entries.value_loc(flag)
            if not isinstance(flag, str) or not FLAG.match(flag):
                raise SpecError(key_loc, f"'{flag}' is not a Megatron flag name", "e.g. --kv-channels")
            if flag in out.locs:
                raise SpecError(key_loc, f"{flag} is in more than one of megatron.flags, structure and no_effect")
            out.locs[flag] = key_loc
            if section == "no_effect":
                if not (isinstance(value, str) and value.strip()):
                    raise SpecError(value_loc, f"{flag} must say why it has no effect on this spec's model, got "
                                    f"{value!r}", "e.g. rotary positions are computed for any length")
                out.no_effect[flag] = value.strip()
            elif section == "flags":
                if not isinstance(value, str) or value not in config:
                    raise SpecError(value_loc, f"{flag} must name a config value of the spec, got {value!r}",
                                    did_you_mean(value, config.keys()))
                out.flags[flag] = str(value)
            else:
                if not (isinstance(value, bool) or (isinstance(value, str) and value.strip())):
                    raise SpecError(value_loc, f"{flag} must be true (a flag without a value), false (not this "
                                    f"structure) or the value that selects this spec's structure, got {value!r}")
                out.structure[flag] = value if isinstance(value, bool) else str(value)
    return out


def _check_checkpoint(raw, loc: Loc) -> None:
    """megatron.checkpoint's form: params (each {specc, megatron, permute?}), ignore and
    extra_state (lists of Megatron names). Which parameters it names is checked against the
    compiled model where it is used (specc_torch/megatron_ckpt), ${...} there too."""
    if not isinstance(raw, LDict):
        raise SpecError(loc, "'megatron.checkpoint' must be a mapping", "e.g. checkpoint: {params: [...]}")
    for key in raw:
        if key not in CHECKPOINT_KEYS:
            raise SpecError(raw.key_loc(key), f"unknown key '{key}' in 'megatron.checkpoint'",
                            did_you_mean(key, CHECKPOINT_KEYS))
    params = raw.get("params")
    if not isinstance(params, LList) or not params:
        raise SpecError(raw.value_loc("params") if "params" in raw else raw.loc,
                        "'megatron.checkpoint.params' must be a non-empty list",
                        "e.g. - {specc: embedding.weight, megatron: embedding.word_embeddings.weight}")
    for i, entry in enumerate(params):
        at = params.item_loc(i)
        if not isinstance(entry, LDict):
            raise SpecError(at, "each megatron.checkpoint.params entry must be a mapping",
                            "e.g. {specc: embedding.weight, megatron: embedding.word_embeddings.weight}")
        for key in entry:
            if key not in CHECKPOINT_PARAM_KEYS:
                raise SpecError(entry.key_loc(key), f"unknown key '{key}' in a megatron.checkpoint.params entry",
                                did_you_mean(key, CHECKPOINT_PARAM_KEYS))
        for key in ("specc", "megatron"):
            if not isinstance(entry.get(key), str) or not entry[key]:
                raise SpecError(entry.value_loc(key) if key in entry else entry.loc,
                                f"'{key}' must be a parameter name", "{i} stands for a layer index")
        permute = entry.get("permute")
        if permute is not None and not (isinstance(permute, LDict) and set(permute) == {"groups", "sections"}
                                        and isinstance(permute["sections"], LList)):
            raise SpecError(entry.value_loc("permute"), "'permute' must be {groups: G, sections: [a, b, ...]}",
                            "Megatron's rows are G groups of [a | b | ...]")
    for key in ("ignore", "extra_state"):
        if key in raw:
            names = raw[key]
            if not isinstance(names, LList) or not all(isinstance(n, str) and n for n in names):
                raise SpecError(raw.value_loc(key), f"'megatron.checkpoint.{key}' must be a list of Megatron names")
