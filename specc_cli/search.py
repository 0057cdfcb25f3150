"""`specc plan SPEC --search --machine M --num-gpus N --global-batch-size B [--top K] [--json]`:
the layout search of specc/plan/search.py on the command line. Layout flags given with --search
fix their dimension (`--tp 8` searches the layouts with TP 8)."""

from __future__ import annotations

import json
import sys

from specc.errors import Loc, SpecError

from .args import overrides_from, recompute_from, settings_from


def cmd_search(args) -> int:
    from specc.plan.machine import load_machine
    from specc.plan.search import Fixed, no_fit_error, search, search_dict, search_text

    if args.machine is None:
        raise SpecError(Loc("--search"), "needs --machine, --num-gpus and --global-batch-size",
                        "specc plan SPEC --search --machine dgx-a100-80gb --num-gpus 64 --global-batch-size 512")
    for flag, value in (("--num-gpus", args.num_gpus), ("--global-batch-size", args.global_batch_size)):
        if value is None:
            raise SpecError(Loc("--search"), f"needs {flag} too", "the search is for a whole job: --num-gpus N "
                            "--global-batch-size B")
        if value < 1:
            raise SpecError(Loc(f"{flag} {value}"), "must be at least 1")
    if args.top < 0:
        raise SpecError(Loc(f"--top {args.top}"), "must be at least 0 (0: every layout that fits)")
    for flag, value in (("--decoder-first-pipeline-num-layers", args.pp_first_stage_layers),
                        ("--decoder-last-pipeline-num-layers", args.pp_last_stage_layers),
                        ("--pipeline-model-parallel-layout", args.pp_layout)):
        if value is not None:
            raise SpecError(Loc(flag), "places layers by hand; --search places them by the cost model",
                            f"drop {flag}")
    machine = load_machine(args.machine)
    base = settings_from(args)  # the flags checked as `specc plan` checks them
    rc = recompute_from(args)
    if rc.get("recompute_granularity") == "full" and (rc["recompute_method"], rc["recompute_num_layers"]) != \
            ("uniform", 1):
        raise SpecError(Loc("--recompute-method"), "--search recomputes full layers one by one (uniform, 1)",
                        "drop --recompute-method and --recompute-num-layers")
    fixed = Fixed(
        tp=args.tp if args.tp != 1 else None, sp=True if args.sp else None,
        cp=args.cp if args.cp != 1 else None, cp_comm_type=args.cp_comm_type if args.cp_comm_type != "auto" else None,
        pp=args.pp if args.pp != 1 else None, vpp=args.pp_virtual_stage_layers,
        ep=args.ep if args.ep != 1 else None,
        micro_batch_size=args.micro_batch_size if args.micro_batch_size != 1 else None,
        recompute=rc.get("recompute_granularity"),
        distributed_optimizer=True if args.use_distributed_optimizer else None)
    res = search(args.spec, base, overrides_from(args), machine, args.num_gpus, args.global_batch_size, fixed,
                 overlap_param_gather=args.overlap_param_gather)
    if not res.candidates:
        raise no_fit_error(res, machine, args.num_gpus)
    if args.json:
        sys.stdout.write(json.dumps({"search": search_dict(res, machine, args.num_gpus, args.global_batch_size,
                                                           args.top)}, indent=2) + "\n")
    else:
        sys.stdout.write(search_text(res, machine, args.spec, args.num_gpus, args.global_batch_size, args.top))
    return 0
