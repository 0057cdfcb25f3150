"""Megatron-LM's model flags on a spec's command line, as the spec's `megatron:` block declares
them (specc/frontend/megatron.py, docs/spec-language.md): a flag in `megatron.flags` sets its
config value; a flag in `megatron.structure` is accepted (it selects what the spec already is);
a flag in `megatron.no_effect` is accepted with a note for the run's log (ns.megatron_notes) saying
why it changes nothing in this spec's model; any other Megatron model flag is a one-line error whose hint names the shipped specs that declare
it. Nothing here knows an architecture: the specs say which flags they answer to. A block that
maps a flag the command line reads itself (specc_cli/args.py CommandLineFlags) is the spec's located
error, on every command, whatever flags are given."""

from __future__ import annotations

import os

from .usage import COMMAND_FLAGS, MEGATRON_NOTES, SPEC_FLAG_OVERRIDES, UsageError

# Megatron's flags that select structure (no spec needs to declare them for the error to say so):
# names of Megatron's command line, not of any spec.
MEGATRON_ARCHITECTURE_FLAGS = (
    "--swiglu", "--squared-relu", "--normalization", "--position-embedding-type", "--use-rotary-position-embeddings",
    "--untie-embeddings-and-output-weights", "--disable-bias-linear", "--add-qkv-bias", "--group-query-attention",
    "--qk-layernorm", "--apply-residual-connection-post-layernorm", "--num-experts", "--multi-latent-attention",
    "--no-position-embedding", "--apply-layernorm-1p", "--rotary-percent",
)
MAX_NAMED = 4  # shipped specs named in one hint


def apply_spec_flags(ns, extras: list, prog: str, errors: list | None = None) -> list:
    """Consume the words of `extras` that are the spec's Megatron flags (their config overrides
    go to ns.spec_flag_overrides, the notes of its no_effect flags to ns.megatron_notes); a Megatron
    model flag the spec does not declare is a UsageError, appended to `errors` (raised when
    `errors` is None); SpecError (located in the spec) for a block mapping a flag of the command
    line (ns.command_flags); return the words left (unrecognized). With no words, only the block
    is checked, and a spec that does not read is left to the compiler, which reports it."""
    from specc.errors import SpecError
    from specc.frontend.megatron import MegatronFlags
    from specc.frontend.megatron_specs import read_megatron, shipped

    spec = getattr(ns, "spec", None)
    declared, spec_name = MegatronFlags(), "the spec"
    if isinstance(spec, str) and os.path.isfile(spec):
        spec_name = spec
        try:
            declared = read_megatron(spec)
        except SpecError as e:  # the spec's own mistake, located in it
            if not extras:
                return extras
            raise SpecError(e.loc, e.what, e.hint or "fix the spec's megatron: block") from None
        declared.refuse(getattr(ns, COMMAND_FLAGS, None))
    others = None  # the shipped specs' declarations, read only when needed
    overrides = getattr(ns, SPEC_FLAG_OVERRIDES, [])
    notes = list(getattr(ns, MEGATRON_NOTES, None) or [])
    left = []
    i = 0
    while i < len(extras):
        word = extras[i]
        flag, eq, value = word.partition("=")
        following = extras[i + 1] if i + 1 < len(extras) else None
        can_take_next = not eq and following is not None and not following.startswith("--")
        if not flag.startswith("--"):
            left.append(word)
            i += 1
            continue
        if flag in declared.flags:
            if not eq and not can_take_next:
                raise UsageError(prog, f"argument {flag}: expected one argument")
            if not eq:
                value, i = following, i + 1
            overrides.append((declared.flags[flag], value, flag))
            i += 1
            continue
        if flag in declared.no_effect:
            if not eq and can_take_next:
                value, i = following, i + 1
            given = f"{flag} {value}" if value else flag
            notes.append(f"{given}: no effect on this model ({spec_name}: {declared.no_effect[flag]})")
            i += 1
            continue
        want = declared.structure.get(flag)
        if want is True and not eq:
            i += 1  # the spec has this structure already
            continue
        if isinstance(want, str) and (eq or can_take_next):
            if not eq:
                value, i = following, i + 1
            if declared.has_structure(flag, value):
                i += 1
                continue
        if others is None:
            others = shipped()
        takes_value = _takes_value(flag, others)
        if takes_value is None and flag not in MEGATRON_ARCHITECTURE_FLAGS:
            left.append(word)
            i += 1
            continue
        if takes_value and not eq and want is None and can_take_next:
            value, i = following, i + 1
        given = f"{flag} {value}" if value else flag
        error = _error(prog, flag, value or None, given, spec_name, declared, others)
        if errors is None:
            raise error
        errors.append(error)
        i += 1
    setattr(ns, SPEC_FLAG_OVERRIDES, overrides)
    setattr(ns, MEGATRON_NOTES, notes)
    return left


def check_spec_block(ns) -> None:
    """The megatron: block of the spec ns.spec against the flags of the command line that parsed
    `ns` (SpecError, located): what parsing does for a SPEC argument, for each of validate's."""
    apply_spec_flags(ns, [], "")


def _takes_value(flag: str, others) -> bool | None:
    """Whether the shipped specs declare `flag` with a value (None: none declares it)."""
    for _, m in others:
        if flag in m.flags or isinstance(m.structure.get(flag), str):
            return True
        if m.structure.get(flag) is True:
            return False
    return None


def _bases_first(paths: list, others) -> list:
    """The specs in `paths`, those extending another one there last (a family's tiny test version
    says nothing its full spec does not), each part in name order."""
    parent = {p: m.extends for p, m in others}
    return sorted(paths, key=lambda p: (parent.get(p) in paths, p))


def _named(paths: list) -> str:
    shown = ", ".join(paths[:MAX_NAMED])
    return shown + (f" and {len(paths) - MAX_NAMED} more" if len(paths) > MAX_NAMED else "")


def _error(prog: str, flag: str, value, given: str, spec: str, declared, others) -> UsageError:
    mapping = sorted({m.flags[flag] for _, m in others if flag in m.flags})
    if mapping:  # a flag that sets a value in other specs
        keys = [k for k in mapping if k in declared.config]
        message = f"{given}: {spec} maps no config value to {flag} (its megatron.flags)"
        if keys:
            return UsageError(prog, message, f"hint: --set {keys[0]}={value if value else 'VALUE'}, or add "
                              f"'{flag}: {keys[0]}' under megatron: flags: in the spec")
        paths = _bases_first([p for p, m in others if flag in m.flags], others)
        example = f"{prog} {paths[0]} {given}"
        return UsageError(prog, message, f"hint: {_named(paths)} map it to {', '.join(mapping)}: {example}")
    paths = _bases_first([p for p, m in others if m.has_structure(flag, value)], others)
    message = f"{given} is a Megatron architecture flag: here the spec holds the architecture, and {spec} " \
              f"does not declare this structure (megatron.structure)"
    if paths:
        return UsageError(prog, message, f"hint: {_named(paths)} {'has' if len(paths) == 1 else 'have'} it: "
                          f"{prog} {paths[0]}")
    choices = sorted({str(m.structure[flag]) for _, m in others if isinstance(m.structure.get(flag), str)})
    if choices:
        return UsageError(prog, message, f"hint: no shipped spec has {given}; they have {flag} "
                          + ", ".join(choices))
    return UsageError(prog, message, "hint: no shipped spec has that structure: write it in a spec "
                      "(docs/spec-language.md)")
