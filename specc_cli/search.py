"""`specc plan SPEC --search --machine M --num-gpus N --global-batch-size B [--top K] [--json]`:
the layout search of specc/plan/search.py on the command line. Layout flags given with --search
fix their dimension (`--tp 8` searches the layouts with TP 8)."""

from __future__ import annotations

import json
import sys

from specc.errors import Loc, SpecError
from specc.settings import FLAG, TABLE

from .args import overrides_from, recompute_from, settings_from

PLACED_BY_HAND = ("pp_first_stage_layers", "pp_last_stage_layers", "pp_layout")  # settings --search refuses
FIXED = {"pp_virtual_stage_layers": "vpp"}  # a setting's name in Fixed where it differs (the rest: the same)


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
    for name in PLACED_BY_HAND:
        if getattr(args, name) is not None:
            raise SpecError(Loc(FLAG[name]), "places layers by hand; --search places them by the cost model",
                            f"drop {FLAG[name]}")
    machine = load_machine(args.machine)
    base = settings_from(args)  # the flags checked as `specc plan` checks them
    rc = recompute_from(args)
    if rc.get("recompute_granularity") == "full" and (rc["recompute_method"], rc["recompute_num_layers"]) != \
            ("uniform", 1):
        raise SpecError(Loc("--recompute-method"), "--search recomputes full layers one by one (uniform, 1)",
                        "drop --recompute-method and --recompute-num-layers")
    given = {f.name: getattr(base, f.name) for f, _ in TABLE if getattr(base, f.name) != f.default}
    fixed = Fixed(**{FIXED.get(name, name): value for name, value in given.items()
                     if FIXED.get(name, name) in Fixed.__dataclass_fields__},
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
