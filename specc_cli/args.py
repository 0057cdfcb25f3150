"""Command-line parsing shared by the `specc` commands and by the training rank's entry
(`torchrun -m specc_cli.rank`): argparse with one-line errors and conflicting duplicate flags
refused, the flags every command that compiles a spec accepts, and their settings and `--set`
overrides."""

from __future__ import annotations

import argparse

from specc.errors import Loc, SpecError
from specc.settings import TABLE as SETTINGS_TABLE
from specc.settings import Settings

from .megatron_flags import apply_spec_flags
from .usage import COMMAND_FLAGS, MEGATRON_NOTES, MEGATRON_REFUSED, SPEC_FLAG_OVERRIDES, UsageError, UsageErrors

MEGATRON_CONFIG_FLAGS = {  # Megatron's model-size flags, applied as config overrides
    "num_layers": "--num-layers", "hidden_size": "--hidden-size", "num_attention_heads": "--num-attention-heads",
    "seq_length": "--seq-length", "ffn_hidden_size": "--ffn-hidden-size",
}


_GIVEN, _PROG = "_specc_given", "_specc_prog"  # bookkeeping kept on the namespace while parsing
MAX_COMMANDS = 6  # commands named in one error


class FlagTable(argparse.Action):
    """A flag of a table of Megatron's flags (add_flag_table): each takes its number of values and
    records, instead of a setting, a note for the run's log (fate "no effect") or a refusal with its
    reason (fate "refused"), which parse_args reports with every other bad flag of the line."""

    def __init__(self, option_strings, dest, fate: str = "", why: str = "", **kwargs):
        super().__init__(option_strings, dest, **kwargs)
        self.fate, self.why = fate, why

    def __call__(self, parser, namespace, values, option_string=None):
        given = " ".join([option_string] + [str(v) for v in (values if isinstance(values, list) else [values])
                                            if self.nargs != 0])
        if self.fate == "no effect":
            line = f"{given}: no effect on this backend ({self.why})"
            notes = list(getattr(namespace, MEGATRON_NOTES, None) or [])
            if line not in notes:
                setattr(namespace, MEGATRON_NOTES, notes + [line])
        else:
            refused = list(getattr(namespace, MEGATRON_REFUSED, None) or [])
            setattr(namespace, MEGATRON_REFUSED, refused + [(given, self.why)])


FATES = ("no effect", "refused")


def add_flag_table(g, table) -> None:
    """Register a table of Megatron's flags: (flag, number of values, fate, why), fate one of
    FATES. A flag of the table keeps no value; it leaves a note or a refusal (FlagTable)."""
    for flag, nvalues, fate, why in table:
        if fate not in FATES:
            raise ValueError(f"{flag}: fate {fate!r} is not one of {FATES}")
        g.add_argument(flag, action=FlagTable, nargs=nvalues if nvalues != 1 else None, dest=MEGATRON_NOTES
                       if fate == "no effect" else MEGATRON_REFUSED, default=[], fate=fate, why=why,
                       metavar="X", help=f"Megatron's; {fate} here: {why}")


class _Once:
    """A flag given twice, under any of its names, with different values is an error: the later
    value would otherwise win silently (`--tp 2 --tensor-model-parallel-size 4`)."""

    def __call__(self, parser, namespace, values, option_string=None):
        value = self.const if self.nargs == 0 else values
        given = namespace.__dict__.setdefault(_GIVEN, {})
        if self.dest in given and given[self.dest][1] != value:
            first = given[self.dest]
            raise argparse.ArgumentError(self, f"given twice with different values: {_given_text(*first, self)} "
                                         f"and {_given_text(option_string, value, self)}")
        given[self.dest] = (option_string, value)
        super().__call__(parser, namespace, values, option_string)


def _given_text(flag, value, action) -> str:
    return flag if action.nargs == 0 else f"{flag} {value}"


class _StoreOnce(_Once, argparse._StoreAction):
    pass


class _StoreConstOnce(_Once, argparse._StoreConstAction):
    pass


class _StoreTrueOnce(_Once, argparse._StoreTrueAction):
    pass


class _StoreFalseOnce(_Once, argparse._StoreFalseAction):
    pass


class CommandLineFlags:
    """The flags a command line reads itself: the option strings of its parsers and of their
    subcommands, at any depth, read from argparse (nothing listed by hand). A spec's `megatron:`
    block cannot map one (MegatronFlags.refuse), nor an abbreviation of one (argparse reads
    `--micro` as `--micro-batch-size`): the command would read it and the spec never see it, so
    `specc plan SPEC --lr 128` would plan another model than `specc train SPEC --lr 128` trains.
    Only text is kept (command, group title, config name), never the parsers."""

    def __init__(self, *parsers):
        self.flags = {}  # flag -> [(command, its group's title or None, the config name it sets or None)]
        config_flags = {flag: key for key, flag in MEGATRON_CONFIG_FLAGS.items()}
        for parser in parsers:
            self._walk(parser, config_flags, set())

    def _walk(self, parser, config_flags: dict, seen: set) -> None:
        if id(parser) in seen:  # a subcommand's aliases share its parser
            return
        seen.add(id(parser))
        untitled = (parser._positionals, parser._optionals)  # argparse's own "options" groups
        titles = {id(action): group.title for group in parser._action_groups if group not in untitled
                  for action in group._group_actions}
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                for sub in action.choices.values():
                    self._walk(sub, config_flags, seen)
            for flag in action.option_strings:
                if flag.startswith("--"):
                    uses = self.flags.setdefault(flag, [])
                    if parser.prog not in (use[0] for use in uses):
                        uses.append((parser.prog, titles.get(id(action)), config_flags.get(flag)))
        own = {flag for action in parser._actions for flag in action.option_strings}
        for other in getattr(parser, "shares_flags_with", ()):  # their flags this parser lacks (the rank's)
            shared = CommandLineFlags()
            shared._walk(other, config_flags, seen)
            for flag, uses in shared.flags.items():
                if flag not in own:
                    known = self.flags.setdefault(flag, [])
                    known += [use for use in uses if use[0] not in (k[0] for k in known)]

    def __call__(self, flag: str):
        """(what, hint) of a spec mapping `flag`; None for a flag no command reads itself."""
        if flag in self.flags:
            uses = self.flags[flag]
            key = next((use[2] for use in uses if use[2]), None)
            if key:  # a model flag, but the commands' own: it sets its config value on every command
                return (f"{flag} is a flag of {_commands(uses)} itself, setting {key}; a spec's megatron: block "
                        f"cannot map it again", f"drop it from the block: {flag} N sets {key} already")
            return (f"{flag} is a flag of {_commands(uses)}{_title(uses)}, not a model setting; a spec's megatron: "
                    f"block maps only model flags", f"drop it from the block: the command line reads {flag} itself")
        longer = sorted(known for known in self.flags if known.startswith(flag))
        if not longer:
            return None
        if len(longer) == 1:
            uses = self.flags[longer[0]]
            what = (f"{flag} abbreviates {longer[0]}, a flag of {_commands(uses)}{_title(uses)}: argparse reads it as "
                    f"that flag")
        else:
            named = ", ".join(longer[:3]) + (f" and {len(longer) - 3} more" if len(longer) > 3 else "")
            uses = list({use[0]: use for known in longer for use in self.flags[known]}.values())
            what = f"{flag} abbreviates {named}, flags of {_commands(uses)}: argparse reads it as one of them"
        return (what + ", not as a model setting; a spec's megatron: block maps only model flags",
                "give the model flag its full Megatron name")


def _commands(uses: list) -> str:
    names, prefixed = [], False
    for name in (use[0] for use in uses):  # specc validate, plan and train: "specc " once
        if name.startswith("specc ") and prefixed:
            name = name[len("specc "):]
        prefixed = prefixed or name.startswith("specc ")
        names.append(name)
    if len(names) > MAX_COMMANDS:
        return ", ".join(names[:MAX_COMMANDS]) + f" and {len(names) - MAX_COMMANDS} more"
    return names[0] if len(names) == 1 else ", ".join(names[:-1]) + " and " + names[-1]


def _title(uses: list) -> str:
    title = next((use[1] for use in uses if use[1]), None)
    return f" ({title.split(' (')[0]})" if title else ""


class ArgumentParser(argparse.ArgumentParser):
    """argparse with one-line errors (UsageError) and conflicting duplicate flags refused. Its
    subparsers are of this class too."""

    shares_flags_with: tuple = ()  # parsers reading the same command line (train's and the rank's entry)

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        for name, cls in ((None, _StoreOnce), ("store", _StoreOnce), ("store_const", _StoreConstOnce),
                          ("store_true", _StoreTrueOnce), ("store_false", _StoreFalseOnce)):
            self.register("action", name, cls)

    def error(self, message):
        raise UsageError(self.prog, message)

    def parse_known_args(self, args=None, namespace=None):
        ns, extras = super().parse_known_args(args, namespace)
        ns.__dict__.pop(_GIVEN, None)
        ns.__dict__.setdefault(_PROG, self.prog)  # the innermost (sub)command's name, for hints
        return ns, extras

    def parse_args(self, args=None, namespace=None):
        import sys

        words = list(sys.argv[1:] if args is None else args)
        ns, extras = self.parse_known_args(words, namespace)
        prog = ns.__dict__.pop(_PROG, self.prog)
        setattr(ns, COMMAND_FLAGS, CommandLineFlags(self))
        errors = [UsageError(prog, f"{given}: {why}", f"hint: drop {given.split()[0]}")
                  for given, why in getattr(ns, MEGATRON_REFUSED, None) or []]
        if extras or isinstance(getattr(ns, "spec", None), str):  # the spec's megatron: block, checked
            extras = apply_spec_flags(ns, extras, prog, errors)  # each message starts with its flag
        flags = [e.message.split()[0].rstrip(":") for e in errors]
        for group in _flag_groups(extras):
            errors.append(UsageError(prog, f"unrecognized arguments: {' '.join(group)}"))
            flags.append(group[0])
        if errors:  # every bad flag of the line at once, in the order given
            first = {}
            for i, word in enumerate(words):
                first.setdefault(word.split("=", 1)[0], i)
            order = sorted(range(len(errors)), key=lambda k: first.get(flags[k].split("=", 1)[0], len(words)))
            errors = [errors[k] for k in order]
            raise errors[0] if len(errors) == 1 else UsageErrors(errors)
        return ns


def _flag_groups(words: list) -> list:
    """Unrecognized words, a flag with the values that follow it per group."""
    groups = []
    for word in words:
        if word.startswith("-") or not groups:
            groups.append([word])
        else:
            groups[-1].append(word)
    return groups


def add_settings_flags(g, names, megatron_first: bool = False) -> None:
    """The flags of the named settings, read from their declarations (specc/settings.py): each
    under Megatron's name and its alias (the alias first unless `megatron_first`)."""
    for f, meta in SETTINGS_TABLE:
        if f.name not in names:
            continue
        flags = meta.flags if megatron_first else tuple(sorted(meta.flags, key=len))
        if meta.kind is bool:
            g.add_argument(*flags, dest=f.name, action="store_false" if f.default else "store_true", help=meta.help)
            continue
        g.add_argument(*flags, dest=f.name, type=meta.kind, default=f.default, choices=meta.choices or None,
                       metavar=None if meta.choices else meta.metavar, help=meta.help)


def spec_flags(p: argparse.ArgumentParser) -> None:
    """Flags every command that compiles a spec accepts (Megatron's names, with short aliases)."""
    g = p.add_argument_group("parallel settings")
    add_settings_flags(g, Settings.names("parallel"))
    add_settings_flags(g, Settings.names("compile"))
    g.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override a config value (or a dotted path in the spec); repeatable")
    for key, flag in MEGATRON_CONFIG_FLAGS.items():
        g.add_argument(flag, dest=f"cfg_{key}", type=int, default=None, metavar="N", help=argparse.SUPPRESS)
    recompute_flags(p)


def recompute_flags(p: argparse.ArgumentParser) -> None:
    """Megatron's activation-recompute flags, with Megatron's meaning (docs/training.md)."""
    add_settings_flags(p.add_argument_group("activation recompute"), Settings.names("recompute"))


def recompute_from(args) -> dict:
    """The recompute settings given on the command line (those not None), their rules checked:
    one located line naming the flag for a combination that has no meaning."""
    given = Settings(**{name: getattr(args, name, None) for name in Settings.names("recompute")}).check_flags()
    return {name: value for name, value in given.group("recompute").items() if value is not None}


def settings_from(args) -> Settings:
    """The Settings of parsed flags (every rule checked, one located line for the first broken)."""
    return Settings(**{f.name: getattr(args, f.name) for f, _ in SETTINGS_TABLE if hasattr(args, f.name)}).check_flags()


def overrides_from(args) -> list:
    import yaml

    out, seen = [], {}
    def scalar(text: str, loc: Loc):
        try:
            value = yaml.safe_load(text) if text.strip() else ""
        except yaml.YAMLError:
            value = text
        if isinstance(value, (dict, list)) or value is None:
            raise SpecError(loc, f"value '{text}' must be a number, boolean or string")
        return value

    for item in args.overrides:
        loc = Loc(f"--set {item}")
        if "=" not in item:
            raise SpecError(loc, "expected KEY=VALUE", "e.g. --set hidden_size=2048")
        key, text = item.split("=", 1)
        out.append((key.strip(), scalar(text, loc), loc))
    for key, text, flag in getattr(args, SPEC_FLAG_OVERRIDES, ()):  # the spec's megatron.flags
        loc = Loc(f"{flag} {text}")
        value = scalar(text, loc)
        if isinstance(value, str):  # Megatron's values are Python's: 1e-6 is a number there (YAML 1.1: a string)
            try:
                value = float(value)
            except ValueError:
                pass
        out.append((key, value, loc))
    for key, flag in MEGATRON_CONFIG_FLAGS.items():
        value = getattr(args, f"cfg_{key}", None)
        if value is not None:
            out.append((key, value, Loc(f"{flag} {value}")))
    for key, value, loc in out:  # the same key twice with different values: the later would win silently
        if key in seen and seen[key][0] != value:
            raise SpecError(loc, f"'{key}' is also set by {seen[key][1]}, to another value", "give it once")
        seen.setdefault(key, (value, loc))
    return out
