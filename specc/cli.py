"""The `specc` command line. Pure text in, text out: nothing here imports torch, except the
commands that run models (verify, train), which import the runtime when they start."""

from __future__ import annotations

import argparse
import sys

from . import __version__
from .errors import Loc, SpecError, _one_line

MEGATRON_CONFIG_FLAGS = {  # Megatron's model-size flags, applied as config overrides
    "num_layers": "--num-layers", "hidden_size": "--hidden-size", "num_attention_heads": "--num-attention-heads",
    "seq_length": "--seq-length", "ffn_hidden_size": "--ffn-hidden-size",
}


_GIVEN, _PROG = "_specc_given", "_specc_prog"  # bookkeeping kept on the namespace while parsing


class UsageError(SystemExit):
    """A mistake on the command line (an unknown flag, a bad value, a missing argument): one line
    `error: WHAT (hint: ...)` and exit code 2, never the whole usage."""

    def __init__(self, prog: str, message: str, hint: str | None = None):
        super().__init__(2)
        self.prog, self.message = prog, message
        self.hint = hint if hint is not None else f"hint: see {prog} --help"

    def format(self) -> str:
        return _one_line(f"error: {self.message} ({self.hint})")


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


class ArgumentParser(argparse.ArgumentParser):
    """argparse with one-line errors (UsageError) and conflicting duplicate flags refused. Its
    subparsers are of this class too."""

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
        ns, extras = self.parse_known_args(args, namespace)
        prog = ns.__dict__.pop(_PROG, self.prog)
        if extras:
            from .commands.train import megatron_architecture_hint

            for i, word in enumerate(extras):
                flag, eq, value = word.partition("=")
                if not eq and i + 1 < len(extras) and not extras[i + 1].startswith("-"):
                    value = extras[i + 1]
                hint = megatron_architecture_hint(flag, value, prog)
                if hint:
                    raise UsageError(prog, f"{flag} is a Megatron architecture flag: here the spec holds the "
                                     f"architecture", hint)
            raise UsageError(prog, f"unrecognized arguments: {' '.join(extras)}")
        return ns


def spec_flags(p: argparse.ArgumentParser, sp_default=False) -> None:
    """Flags every command that compiles a spec accepts (Megatron's names, with short aliases)."""
    g = p.add_argument_group("parallel settings")
    g.add_argument("--tp", "--tensor-model-parallel-size", dest="tp", type=int, default=1, metavar="N",
                   help="tensor-parallel size (default 1)")
    g.add_argument("--sp", "--sequence-parallel", dest="sp", action="store_true", default=sp_default,
                   help="sequence parallelism in the regions between tensor-parallel GEMMs")
    g.add_argument("--cp", "--context-parallel-size", dest="cp", type=int, default=1, metavar="N",
                   help="context-parallel size: the sequence sharded over N ranks in load-balanced chunks (default 1)")
    g.add_argument("--cp-comm-type", dest="cp_comm_type", choices=("auto", "p2p", "all_gather"), default="auto",
                   help="attention over the context-parallel group: p2p (ring), all_gather, or auto (the cost model)")
    g.add_argument("--backend", choices=("auto", "native", "te"), default="auto",
                   help="implementation for ops that say impl: auto (default auto: TransformerEngine where installed)")
    g.add_argument("--micro-batch-size", type=int, default=1, metavar="B", help="micro-batch size for sizes in the plan")
    g.add_argument("--dtype", choices=("bf16", "fp16", "fp32"), default="bf16", help="activation/parameter dtype for bytes")
    g.add_argument("--no-fuse", dest="fuse", action="store_false",
                   help="keep every boundary as its own call (no absorption into GEMMs)")
    g.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override a config value (or a dotted path in the spec); repeatable")
    for key, flag in MEGATRON_CONFIG_FLAGS.items():
        g.add_argument(flag, dest=f"cfg_{key}", type=int, default=None, metavar="N", help=argparse.SUPPRESS)


def settings_from(args):
    from .frontend.model import Settings

    if args.tp < 1:
        raise SpecError(Loc("--tensor-model-parallel-size"), f"must be at least 1, got {args.tp}")
    if args.micro_batch_size < 1:
        raise SpecError(Loc("--micro-batch-size"), f"must be at least 1, got {args.micro_batch_size}")
    if args.sp and args.tp == 1:
        raise SpecError(Loc("--sequence-parallel"), "needs --tensor-model-parallel-size 2 or more (sequence "
                        "parallelism shards the sequence over the tensor-parallel ranks)", "add --tp N, or drop --sp")
    if args.cp < 1:
        raise SpecError(Loc("--context-parallel-size"), f"must be at least 1, got {args.cp}")
    if args.cp_comm_type != "auto" and args.cp == 1:
        raise SpecError(Loc("--cp-comm-type"), "has no effect without context parallelism",
                        "add --context-parallel-size N, or drop --cp-comm-type")
    return Settings(tp=args.tp, sp=args.sp and args.tp > 1, backend=args.backend,
                    micro_batch_size=args.micro_batch_size, dtype=args.dtype, fuse=args.fuse, cp=args.cp,
                    cp_comm_type=args.cp_comm_type)


def overrides_from(args) -> list:
    import yaml

    out, seen = [], {}
    for item in args.overrides:
        loc = Loc(f"--set {item}")
        if "=" not in item:
            raise SpecError(loc, "expected KEY=VALUE", "e.g. --set hidden_size=2048")
        key, text = item.split("=", 1)
        try:
            value = yaml.safe_load(text) if text.strip() else ""
        except yaml.YAMLError:
            value = text
        if isinstance(value, (dict, list)) or value is None:
            raise SpecError(loc, f"value '{text}' must be a number, boolean or string")
        out.append((key.strip(), value, loc))
    for key, flag in MEGATRON_CONFIG_FLAGS.items():
        value = getattr(args, f"cfg_{key}", None)
        if value is not None:
            out.append((key, value, Loc(f"{flag} {value}")))
    for key, value, loc in out:  # the same key twice with different values: the later would win silently
        if key in seen and seen[key][0] != value:
            raise SpecError(loc, f"'{key}' is also set by {seen[key][1]}, to another value", "give it once")
        seen.setdefault(key, (value, loc))
    return out


def compile_args(args):
    """(spec, graph) for a SPEC argument and the common flags."""
    from .pipeline import load_and_compile

    return load_and_compile(args.spec, settings_from(args), overrides_from(args))


# -- commands ------------------------------------------------------------------------------------

def cmd_validate(args) -> int:
    from .summary import summarize

    failed = 0
    for path in args.specs:
        args.spec = path
        try:
            _, graph = compile_args(args)
        except SpecError as e:
            print(e.format(), file=sys.stderr)
            failed += 1
            continue
        print(f"{path}: ok: {summarize(graph)}")
    return 2 if failed else 0


def cmd_schema(args) -> int:
    from .schema import schema_text

    sys.stdout.write(schema_text())
    return 0


def cmd_plan(args) -> int:
    from .plan import build_plan, plan_json, plan_text

    _, graph = compile_args(args)
    plan = build_plan(graph)
    sys.stdout.write(plan_json(plan) if args.json else plan_text(plan))
    return 0


def cmd_graph(args) -> int:
    from .graphviz import to_dot, write_outputs

    _, graph = compile_args(args)
    written = write_outputs(to_dot(graph), args.output)
    for path in written:
        print(f"wrote {path}", file=sys.stderr)
    return 0


def cmd_diff(args) -> int:
    from .plan.diff import diff_plans, load_side

    a = load_side(args.a, args.a_flags)
    b = load_side(args.b, args.b_flags)
    text, differ = diff_plans(a, b)
    sys.stdout.write(text)
    return 1 if differ else 0


def cmd_compile(args) -> int:
    from .emit.write import compile_to_dir
    from .frontend.load import MAX_NAME
    from .pipeline import load_and_compile

    if args.name is not None and len(args.name) > MAX_NAME:
        raise SpecError(Loc("--name"), f"the name is {len(args.name)} characters long, at most {MAX_NAME}",
                        "it names the generated folder")
    from .emit.recipe import command_of, make_recipe

    settings, overrides = settings_from(args), overrides_from(args)
    recipe = make_recipe(args.spec, settings, overrides)
    spec, graph = load_and_compile(args.spec, settings, overrides)
    out = compile_to_dir(spec, graph, args.output, command_of(recipe), args.name, recipe)
    print(f"wrote {out}/model.py, plan.txt, plan.json, graph.dot", file=sys.stderr)
    return 0


def cmd_verify(args) -> int:
    for flag, value, least in (("--steps", args.steps, 1), ("--batch", args.batch, 1)):
        if value < least:
            raise SpecError(Loc(f"{flag} {value}"), f"must be at least {least}")
    if not 0 < args.tolerance < float("inf"):
        raise SpecError(Loc(f"--tolerance {args.tolerance}"), "must be a positive number")
    tps = _int_list(args.tp_list, "--tp")
    cps = _int_list(args.cp_list, "--cp")
    comms = {"auto": ["auto"], "p2p": ["p2p"], "all_gather": ["all_gather"], "both": ["p2p", "all_gather"]}[
        args.cp_comm_mode]
    sps = {"on": [True], "off": [False], "both": [False, True]}[args.sp_mode]
    located = overrides_from(args)
    overrides = {key: value for key, value, _ in located}
    from .frontend.model import Settings
    from .pipeline import load_and_compile

    for cp in cps:  # a bad spec or setting fails here, in one line, before any rank starts
        for tp in tps:
            for sp in sps if tp > 1 else [False]:
                load_and_compile(args.spec, Settings(tp=tp, sp=sp, cp=cp, micro_batch_size=args.batch, dtype="fp32"),
                                 located)
    from runtime.verify import MUTATIONS, RankFailure, VerifyConfig, format_table, verify  # imports torch: only now

    if args.mutate is not None and args.mutate not in MUTATIONS:
        from .errors import did_you_mean

        raise SpecError(Loc(f"--mutate {args.mutate}"), "unknown mutation", did_you_mean(args.mutate, MUTATIONS))

    cfg = VerifyConfig(spec=args.spec, tps=sorted(set([1] + tps)), sps=sps, steps=args.steps, seed=args.seed,
                       batch=args.batch, overrides=overrides, tolerance=args.tolerance, mutate=args.mutate,
                       tp_invariant_dropout=args.tp_invariant_dropout, cps=sorted(set([1] + cps)), cp_comm_types=comms)
    cp_text = f", cp {','.join(map(str, cfg.cps))} ({args.cp_comm_mode})" if max(cfg.cps) > 1 else ""
    print(f"specc verify {args.spec}: tp {','.join(map(str, cfg.tps))}{cp_text}, sp {args.sp_mode}, {cfg.steps} steps, "
          f"batch {cfg.batch}, seed {cfg.seed}" + (f", MUTATION {cfg.mutate}" if cfg.mutate else ""), flush=True)
    try:
        rows = verify(cfg)
    except RankFailure as e:
        print(_one_line(f"error: specc verify: {e}"), file=sys.stderr)
        return 2
    sys.stdout.write(format_table(rows))
    failed = [r for r in rows if not r.ok]
    settings = len({r.setting for r in rows})
    print(f"{len(rows) - len(failed)} passed, {len(failed)} failed ({settings} settings)")
    return 1 if failed else 0


def _int_list(text: str, flag: str) -> list:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise SpecError(Loc(f"{flag} {text}"), "expected comma-separated integers, e.g. 1,2,4") from None
    if not values or min(values) < 1:
        raise SpecError(Loc(f"{flag} {text}"), "sizes must be at least 1")
    return values


def cmd_check(args) -> int:
    from .emit.write import check_generated

    return check_generated(args.generated, sys.stdout)


def build_parser() -> argparse.ArgumentParser:
    p = ArgumentParser(prog="specc", description="Compile declarative model specs into tensor- and "
                                "sequence-parallel PyTorch modules and parallel plans.")
    p.add_argument("--version", action="version", version=f"specc {__version__}")
    sub = p.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True

    c = sub.add_parser("validate", help="check specs and print a one-line summary of each")
    c.add_argument("specs", nargs="+", metavar="SPEC")
    spec_flags(c)
    c.set_defaults(func=cmd_validate)

    c = sub.add_parser("schema", help="print the JSON Schema of the spec language")
    c.set_defaults(func=cmd_schema)

    c = sub.add_parser("plan", help="print the parallel plan of a spec")
    c.add_argument("spec", metavar="SPEC")
    spec_flags(c)
    c.add_argument("--json", action="store_true", help="print JSON instead of text")
    c.set_defaults(func=cmd_plan)

    c = sub.add_parser("diff", help="compare two plans (specs with their own flags, or saved plan.json files); "
                       "exit 1 when they differ",
                       description="Each side is a spec or a plan.json. Flags for a side follow it in quotes: "
                       "specc diff specs/gpt.yaml specs/gpt.yaml --b-flags '--tp 2 --sp'")
    c.add_argument("a", metavar="A")
    c.add_argument("b", metavar="B")
    c.add_argument("--a-flags", default="", metavar="FLAGS", help="flags for side A, e.g. '--tp 2'")
    c.add_argument("--b-flags", default="", metavar="FLAGS", help="flags for side B")
    c.set_defaults(func=cmd_diff)

    c = sub.add_parser("graph", help="write the op graph as Graphviz dot (and SVG when `dot` is installed)")
    c.add_argument("spec", metavar="SPEC")
    spec_flags(c)
    c.add_argument("-o", "--output", default="graph.dot", help="output .dot path (default graph.dot)")
    c.set_defaults(func=cmd_graph)

    c = sub.add_parser("compile", help="write generated/NAME/: model.py, plan.txt, plan.json, graph.dot")
    c.add_argument("spec", metavar="SPEC")
    spec_flags(c)
    c.add_argument("-o", "--output", default="generated", help="output root (default generated/)")
    c.add_argument("--name", default=None, help="directory name under the output root (default: the spec's name and settings)")
    c.set_defaults(func=cmd_compile)

    c = sub.add_parser("verify", help="run compiled plans on gloo ranks and compare with TP=1 (imports torch)")
    c.add_argument("spec", metavar="SPEC")
    c.add_argument("--tp", dest="tp_list", default="1,2,4", metavar="N,N", help="TP sizes to check (default 1,2,4)")
    c.add_argument("--sp", dest="sp_mode", choices=("on", "off", "both"), default="both",
                   help="sequence parallelism (default both)")
    c.add_argument("--cp", "--context-parallel-size", dest="cp_list", default="1", metavar="N,N",
                   help="context-parallel sizes to check, each with every TP size (default 1)")
    c.add_argument("--cp-comm-type", dest="cp_comm_mode", choices=("auto", "p2p", "all_gather", "both"),
                   default="both", help="attention over CP: the cost model's choice, one, or both (default both)")
    c.add_argument("--steps", type=int, default=2, metavar="K", help="optimizer steps compared (default 2)")
    c.add_argument("--seed", type=int, default=1234)
    c.add_argument("--batch", type=int, default=2, metavar="B", help="micro-batch size (default 2)")
    c.add_argument("--tolerance", type=float, default=1e-4, help="relative tolerance per tensor (default 1e-4)")
    c.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    c.add_argument("--tp-invariant-dropout", action="store_true",
                   help="draw dropout masks for the full tensor and slice them, so runs with dropout compare "
                        "exactly (without it, dropout is compared statistically)")
    c.add_argument("--mutate", default=None, metavar="NAME",
                   help="break the compiled module on purpose (drop-partial-grad, one-slab-segments, drop-reduction)")
    for key, flag in MEGATRON_CONFIG_FLAGS.items():
        c.add_argument(flag, dest=f"cfg_{key}", type=int, default=None, help=argparse.SUPPRESS)
    c.set_defaults(func=cmd_verify)

    c = sub.add_parser("check", help="fail with a diff when generated/ is stale")
    c.add_argument("generated", nargs="?", default="generated", help="the generated root (default generated/)")
    c.set_defaults(func=cmd_check)

    from .commands import register_all  # train, data, plot, hf: each in its own module

    register_all(sub)
    return p


def main(argv=None) -> int:
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except UsageError as e:
        print(e.format(), file=sys.stderr)
        return 2
    try:
        return args.func(args)
    except (SpecError, UsageError) as e:  # UsageError: flags parsed inside a command (diff's --a-flags)
        print(e.format(), file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("specc: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        return 0


if __name__ == "__main__":
    sys.exit(main())
