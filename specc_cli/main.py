"""The `specc` command line. Pure text in, text out: nothing here imports torch, except the
commands that run models (verify, train, hf, data), which import specc_torch (or the runtime)
when they start. The parsing kit they share is specc_cli/args.py."""

from __future__ import annotations

import argparse
import sys

from specc import __version__
from specc.errors import Loc, SpecError, _one_line
from specc_cli.args import (
    MEGATRON_CONFIG_FLAGS,
    ArgumentParser,
    UsageError,
    add_settings_flags,
    overrides_from,
    recompute_flags,
    recompute_from,
    settings_from,
    spec_flags,
)

from . import calibrate, data, hf, megatron_ckpt, plot, train


def compile_args(args):
    """(spec, graph) for a SPEC argument and the common flags, for the commands that only plan
    (validate, plan, graph, diff): a backend asked for by name need not be installed here."""
    from specc.compiler import load_and_compile

    return load_and_compile(args.spec, settings_from(args), overrides_from(args), plan_only=True)


# -- commands ------------------------------------------------------------------------------------

def cmd_validate(args) -> int:
    from specc.summary import summarize

    from .megatron_flags import check_spec_block

    failed = 0
    for path in args.specs:
        args.spec = path
        try:
            check_spec_block(args)  # a megatron: block that maps a flag the command line reads itself
            _, graph = compile_args(args)
        except SpecError as e:
            print(e.format(), file=sys.stderr)
            failed += 1
            continue
        print(f"{path}: ok: {summarize(graph)}")
    return 2 if failed else 0


def cmd_schema(args) -> int:
    from specc.schema import schema_text

    sys.stdout.write(schema_text())
    return 0


def cmd_plan(args) -> int:
    from specc.plan import build_plan, plan_json, plan_text

    if args.search:
        from .search import cmd_search

        return cmd_search(args)
    machine, job = _prediction_args(args)
    spec, graph = compile_args(args)
    plan = build_plan(graph)
    if machine is None:
        sys.stdout.write(plan_json(plan) if args.json else plan_text(plan))
        return 0
    import json

    from specc.plan.render import plan_dict, prediction_text
    from specc.plan.time import predict

    shape = spec.inputs[0].shape if spec.inputs else (plan.settings.micro_batch_size,)
    tokens = 1
    for d in shape:
        tokens *= d
    pred = predict(plan, tokens // plan.settings.micro_batch_size, machine, job)
    if args.json:
        sys.stdout.write(json.dumps({**plan_dict(plan), "prediction": pred}, indent=2) + "\n")
    else:
        sys.stdout.write(plan_text(plan) + prediction_text(pred))
    return 0


def _prediction_args(args):
    """(Machine, Job) of --machine, --num-gpus, --global-batch-size, --use-distributed-optimizer;
    (None, None) without --machine. Checked before anything compiles."""
    given = [flag for flag, value in (("--num-gpus", args.num_gpus), ("--global-batch-size", args.global_batch_size))
             if value is not None] + (["--use-distributed-optimizer"] if args.use_distributed_optimizer else []) + \
        (["--overlap-param-gather"] if args.overlap_param_gather else []) + \
        (["--no-overlap-grad-reduce"] if not args.overlap_grad_reduce else [])
    if args.machine is None:
        if given:
            raise SpecError(Loc(given[0]), "has no effect without --machine", "add --machine NAME (specc plan "
                            "--machine dgx-a100-80gb ...), or drop it")
        return None, None
    for flag, value in (("--num-gpus", args.num_gpus), ("--global-batch-size", args.global_batch_size)):
        if value is None:
            raise SpecError(Loc(f"--machine {args.machine}"), f"needs {flag} too", "the prediction is of a whole "
                            "job: --num-gpus N --global-batch-size B")
        if value < 1:
            raise SpecError(Loc(f"{flag} {value}"), "must be at least 1")
    from specc.plan.machine import load_machine
    from specc.plan.time import Job

    if args.overlap_param_gather and not args.use_distributed_optimizer and not args.search:
        raise SpecError(Loc("--overlap-param-gather"), "needs --use-distributed-optimizer (it overlaps the "
                        "distributed optimizer's parameter all-gather)", "add --use-distributed-optimizer")
    return load_machine(args.machine), Job(args.num_gpus, args.global_batch_size, args.use_distributed_optimizer,
                                           args.overlap_grad_reduce, args.overlap_param_gather)


def cmd_graph(args) -> int:
    from specc.graphviz import to_dot, write_outputs

    _, graph = compile_args(args)
    written = write_outputs(to_dot(graph), args.output)
    for path in written:
        print(f"wrote {path}", file=sys.stderr)
    return 0


def cmd_diff(args) -> int:
    from specc.plan.diff import diff_plans, load_side

    def plan_graph(spec: str, words: list):  # a spec side: its flags read as `specc plan` reads them
        return compile_args(build_parser().parse_args(["plan", spec, *words]))[1]

    a = load_side(args.a, args.a_flags, plan_graph)
    b = load_side(args.b, args.b_flags, plan_graph)
    text, differ = diff_plans(a, b)
    sys.stdout.write(text)
    return 1 if differ else 0


def cmd_compile(args) -> int:
    from specc.compiler import load_and_compile
    from specc.emit.write import compile_to_dir
    from specc.frontend.load import MAX_NAME

    if args.name is not None and len(args.name) > MAX_NAME:
        raise SpecError(Loc("--name"), f"the name is {len(args.name)} characters long, at most {MAX_NAME}",
                        "it names the generated folder")
    from specc.emit.recipe import command_of, make_recipe

    settings, overrides = settings_from(args), overrides_from(args)
    recipe = make_recipe(args.spec, settings, overrides)
    spec, graph = load_and_compile(args.spec, settings, overrides)
    out = compile_to_dir(spec, graph, args.output, command_of(recipe), args.name, recipe)
    print(f"wrote {out}/model.py, plan.txt, plan.json, graph.dot", file=sys.stderr)
    return 0


PACKED = ("reset_position_ids", "reset_attention_mask")  # Megatron's packed-document settings verify takes


def cmd_verify(args) -> int:
    for flag, value, least in (("--steps", args.steps, 1), ("--batch", args.batch, 1)):
        if value < least:
            raise SpecError(Loc(f"{flag} {value}"), f"must be at least {least}")
    if not 0 < args.tolerance < float("inf"):
        raise SpecError(Loc(f"--tolerance {args.tolerance}"), "must be a positive number")
    tps = _int_list(args.tp_list, "--tp")
    cps = _int_list(args.cp_list, "--cp")
    eps = _int_list(args.ep_list, "--ep")
    pps = _int_list(args.pp_list, "--pp")
    dps = _int_list(args.dp_list, "--dp")
    virtual = [None] if args.vpp_list is None else _int_list(args.vpp_list, "--num-layers-per-virtual-pipeline-stage")
    comms = {"auto": ["auto"], "p2p": ["p2p"], "all_gather": ["all_gather"], "both": ["p2p", "all_gather"]}[
        args.cp_comm_mode]
    sps = {"on": [True], "off": [False], "both": [False, True]}[args.sp_mode]
    located = overrides_from(args)
    overrides = {key: value for key, value, _ in located}
    recompute = recompute_from(args)
    packed = {name: getattr(args, name) for name in PACKED}  # every model takes the same packed documents
    from specc.compiler import load_and_compile
    from specc.settings import Settings

    if max(eps) > 1 and max(cps) > 1:
        raise SpecError(Loc("--ep"), "expert parallelism with context parallelism is not supported yet",
                        "check --ep and --cp in separate runs")
    for cp in cps:  # a bad spec or setting fails here, in one line, before any rank starts
        for tp in tps:
            for ep in eps:
                for sp in sps if tp > 1 else [False]:
                    load_and_compile(args.spec, Settings(tp=tp, sp=sp, cp=cp, micro_batch_size=args.batch,
                                                         dtype="fp32", ep=ep, **recompute, **packed), located)
            for sp in sps if tp > 1 else [False]:
                for pp in [x for x in pps if x > 1]:
                    for v in virtual:
                        load_and_compile(args.spec, Settings(tp=tp, sp=sp, cp=cp, pp=pp, pp_virtual_stage_layers=v,
                                                             dtype="fp32", **packed), located)
    if max(pps) > 1:  # every pipeline setting runs on all the ranks: the smallest ones over the most DP ranks
        import math

        world = 1
        for tp in tps + [1]:
            for cp in cps + [1]:
                world = math.lcm(world, tp * cp)
                for pp in pps:
                    world = math.lcm(world, tp * cp * pp * max(dps))
        for pp in [x for x in pps if x > 1]:
            dp = world // pp
            if args.batch % dp or args.batch // dp < pp:
                raise SpecError(Loc(f"--batch {args.batch}"), f"PP={pp} runs on {world} ranks with DP={dp}: the batch "
                                f"must split into {dp} equal shares of at least {pp} micro-batches",
                                f"use --batch {dp * pp}")
    from specc_torch.verify import MUTATIONS, RankFailure, VerifyConfig, format_table, verify  # imports torch: only now

    if args.mutate is not None and args.mutate not in MUTATIONS:
        from specc.errors import did_you_mean

        raise SpecError(Loc(f"--mutate {args.mutate}"), "unknown mutation", did_you_mean(args.mutate, MUTATIONS))

    cfg = VerifyConfig(spec=args.spec, tps=sorted(set([1] + tps)), sps=sps, steps=args.steps, seed=args.seed,
                       batch=args.batch, overrides=overrides, tolerance=args.tolerance, mutate=args.mutate,
                       tp_invariant_dropout=args.tp_invariant_dropout, cps=sorted(set([1] + cps)), cp_comm_types=comms,
                       torch_compile=args.torch_compile_backend if args.torch_compile else None,
                       eps=sorted(set([1] + eps)), recompute=recompute, packed=packed,
                       pps=sorted(set(pps)), pp_virtual=virtual, dps=sorted(set(dps)), pp_schedule=args.pp_schedule)
    cp_text = f", cp {','.join(map(str, cfg.cps))} ({args.cp_comm_mode})" if max(cfg.cps) > 1 else ""
    cp_text += f", ep {','.join(map(str, cfg.eps))}" if max(cfg.eps) > 1 else ""
    if max(pps) > 1:
        cp_text += f", pp {','.join(map(str, cfg.pps))}" + (f" (vpp {args.vpp_list})" if args.vpp_list else "") + \
            (f", dp {','.join(map(str, cfg.dps))}" if max(dps) > 1 else "")
    print(f"specc verify {args.spec}: tp {','.join(map(str, cfg.tps))}{cp_text}, sp {args.sp_mode}, {cfg.steps} steps, "
          f"batch {cfg.batch}, seed {cfg.seed}" + (f", MUTATION {cfg.mutate}" if cfg.mutate else "") +
          (f", torch.compile ({cfg.torch_compile}) against the eager reference" if cfg.torch_compile else "")
          + (", recompute " + " ".join(str(v) for v in recompute.values() if v is not None) if recompute else "")
          + "".join(f", {name}" for name, on in packed.items() if on),
          flush=True)
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
    from specc.emit.write import check_generated

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
    g = c.add_argument_group("prediction (docs/planning.md)")
    g.add_argument("--machine", default=None, metavar="NAME|FILE",
                   help="predict the step on a machine profile: a shipped name (dgx-a100-80gb, dgx-h100-80gb, "
                   "dgx-h200) or a profile file")
    g.add_argument("--num-gpus", type=int, default=None, metavar="N",
                   help="GPUs of the job; the data-parallel size is N / (tp x cp x pp)")
    g.add_argument("--global-batch-size", type=int, default=None, metavar="B",
                   help="samples per step, over micro-batches and data-parallel ranks")
    g.add_argument("--use-distributed-optimizer", action="store_true",
                   help="Adam's state sharded over the data-parallel ranks (gradients reduce-scattered, "
                   "parameters all-gathered)")
    g.add_argument("--no-overlap-grad-reduce", dest="overlap_grad_reduce", action="store_false",
                   help="the data-parallel gradient reduction after backward instead of beside it")
    g.add_argument("--overlap-param-gather", action="store_true",
                   help="with --use-distributed-optimizer: the parameter all-gather runs until the next forward "
                   "needs it")
    g.add_argument("--search", action="store_true",
                   help="enumerate every layout (tp, sp, cp, pp, vpp, ep, dp, micro-batch size, recompute, "
                   "distributed optimizer) that fits, ranked by predicted step time; layout flags given fix theirs")
    g.add_argument("--top", type=int, default=10, metavar="K", help="with --search: how many to show (default 10; "
                   "0: all)")
    c.set_defaults(func=cmd_plan)

    c = sub.add_parser("diff", help="compare two plans (specs with their own flags, or saved plan.json files); "
                       "exit 1 when they differ",
                       description="Each side is a spec, a plan.json or a generated folder. A spec side's flags "
                       "go in one quoted word: specc diff specs/gpt.yaml specs/gpt.yaml --a-flags '--tp 1' "
                       "--b-flags '--tp 2 --sp'. Prints one line per changed field (settings, each op's "
                       "layouts, collectives, weight shapes, saved bytes, notes) and the changed totals, "
                       "gradient-sync all-reduces included.")
    c.add_argument("a", metavar="A")
    c.add_argument("b", metavar="B")
    c.add_argument("--a-flags", default="", metavar="FLAGS", help="flags for side A, one quoted word, e.g. '--tp 2 --sp'")
    c.add_argument("--b-flags", default="", metavar="FLAGS", help="flags for side B, one quoted word")
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
    c.add_argument("--ep", "--expert-model-parallel-size", dest="ep_list", default="1", metavar="N,N",
                   help="expert-parallel sizes to check, each with every TP size it fits beside (default 1); "
                        "with EP > 1 every data-parallel rank gets its own batches")
    c.add_argument("--pp", "--pipeline-model-parallel-size", dest="pp_list", default="1", metavar="N,N",
                   help="pipeline sizes to check, each with every TP/CP setting (default 1)")
    c.add_argument("--num-layers-per-virtual-pipeline-stage", dest="vpp_list", default=None, metavar="N,N",
                   help="interleaved pipeline settings: layers per virtual stage")
    c.add_argument("--dp", dest="dp_list", default="1", metavar="N,N",
                   help="data-parallel sizes of the pipeline settings (each DP rank its share of the batch)")
    c.add_argument("--pp-schedule", dest="pp_schedule", default=None,
                   choices=("1f1b", "gpipe", "interleaved_1f1b", "interleaved_zero_bubble"),
                   help="the torch.distributed.pipelining schedule (default 1f1b; interleaved_1f1b with virtual stages)")
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
    c.add_argument("--torch-compile", action="store_true",
                   help="torch.compile the checked models' repeated layers; the TP=1 reference stays eager")
    c.add_argument("--torch-compile-backend", default="inductor", choices=("inductor", "aot_eager", "eager"),
                   help="the torch.compile backend (default inductor)")
    for key, flag in MEGATRON_CONFIG_FLAGS.items():
        c.add_argument(flag, dest=f"cfg_{key}", type=int, default=None, help=argparse.SUPPRESS)
    recompute_flags(c)  # the compiled models recompute; the TP=1 reference does not
    add_settings_flags(c.add_argument_group("packed documents (every model, the TP=1 reference too)"), PACKED)
    c.set_defaults(func=cmd_verify)

    c = sub.add_parser("check", help="fail with a diff when generated/ is stale")
    c.add_argument("generated", nargs="?", default="generated", help="the generated root (default generated/)")
    c.set_defaults(func=cmd_check)

    for module in (train, data, plot, hf, megatron_ckpt, calibrate):  # each command in its own module
        module.add_parsers(sub)
    return p


def _join_side_flags(argv: list) -> list:
    """`--a-flags '--sp'` as `--a-flags=--sp`: argparse would read a lone `--sp` value as an option."""
    out, i = [], 0
    while i < len(argv):
        if argv[i] in ("--a-flags", "--b-flags") and i + 1 < len(argv):
            out.append(f"{argv[i]}={argv[i + 1]}")
            i += 2
        else:
            out.append(argv[i])
            i += 1
    return out


def main(argv=None) -> int:
    parser = build_parser()
    argv = _join_side_flags(list(sys.argv[1:] if argv is None else argv))
    try:
        args = parser.parse_args(argv)
    except (SpecError, UsageError) as e:  # SpecError: the spec's megatron: block, read while parsing flags
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
