"""`specc plan --search`: every legal layout of a spec on a machine, the ones that fit, ranked by
the time model's step time (specc/plan/time.py). docs/planning.md describes it.

Enumerated: TP (dividing a node's devices), SP, CP with both attention variants, PP and its
interleaved virtual stages, EP (specs with expert weights), DP (what the GPU count leaves),
micro-batch sizes, recompute (none, selective, full) and the distributed optimizer. Fast because
the compiler runs once per compile-relevant part of a layout (tp, sp, cp, its comm type, ep,
micro-batch size, recompute): the passes before the pipeline cut do not read the pipeline
settings, so every PP and virtual-stage setting cuts the same compiled graph again
(passes.pipeline.cut_pipeline) and re-assembles the plan from the same per-op entries
(build.assemble_plan); DP and the distributed optimizer are the time model's alone. Each
candidate's prediction is exactly the single-layout `specc plan --machine` one
(tests/specc/plan/test_search.py checks it against brute force).
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field

from ..compiler import load_and_compile
from ..errors import Loc, SpecError
from ..layouts import DTYPE_BYTES
from ..passes.pipeline import cut_pipeline
from ..settings import SHORT_FLAG, Settings
from .build import OPT_BYTES, assemble_plan, plan_entries
from .render import human_bytes
from .time import LABELS, Job, predict

MICRO_BATCH_SIZES = (1, 2, 4, 8, 16)
RECOMPUTE = {"none": {}, "selective": {"recompute_granularity": "selective"},
             "full": {"recompute_granularity": "full", "recompute_method": "uniform", "recompute_num_layers": 1}}
SHORT = ("tp", "sp", "cp", "cp_comm_type", "pp", "vpp", "ep", "dp", "micro_batch_size", "recompute",
         "distributed_optimizer")


@dataclass(frozen=True)
class Fixed:
    """Dimensions the user fixed on the command line (None: searched)."""

    tp: int | None = None
    sp: bool | None = None
    cp: int | None = None
    cp_comm_type: str | None = None
    pp: int | None = None
    vpp: int | None = None  # layers per virtual stage
    ep: int | None = None
    micro_batch_size: int | None = None
    recompute: str | None = None
    distributed_optimizer: bool | None = None


@dataclass
class Result:
    candidates: list  # (prediction, layout dict), best first
    evaluated: int = 0
    compiled: int = 0
    pruned: dict = field(default_factory=dict)  # reason -> [count, example layout text]
    smallest_misfit: tuple | None = None  # (bytes, layout dict) of the smallest that did not fit
    floor_misfit: tuple | None = None  # (lower bound, layout) of the smallest pruned before compiling
    seconds: float = 0.0
    cpu_seconds: float = 0.0

    def prune(self, reason: str, layout: dict, n: int = 1) -> None:
        entry = self.pruned.setdefault(reason, [0, layout_text(layout)])
        entry[0] += n


def layout_text(lay: dict) -> str:
    parts = [f"tp {lay['tp']}"] + (["sp"] if lay.get("sp") else [])
    if lay.get("cp", 1) > 1:
        parts.append(f"cp {lay['cp']} ({lay.get('cp_comm_type')})")
    for key, name in (("pp", "pp"), ("ep", "ep"), ("dp", "dp")):
        if key in lay and (lay[key] > 1 or key == "pp"):
            parts.append(f"{name} {lay[key]}")
    if lay.get("vpp"):
        parts.append(f"vpp {lay['vpp']} layers")
    if "micro_batch_size" in lay:
        parts.append(f"mbs {lay['micro_batch_size']}")
    if lay.get("recompute", "none") != "none":
        parts.append(f"recompute {lay['recompute']}")
    if lay.get("distributed_optimizer"):
        parts.append("dist-opt")
    return " ".join(parts)


def layout_flags(lay: dict) -> str:
    """The layout as `specc plan` / `compile` / `train` flags (each setting's flag from the table)."""
    f = SHORT_FLAG
    out = [f"{f['tp']} {lay['tp']}"] + ([f["sp"]] if lay["sp"] else [])
    if lay["cp"] > 1:
        out.append(f"{f['cp']} {lay['cp']} {f['cp_comm_type']} {lay['cp_comm_type']}")
    if lay["pp"] > 1:
        out.append(f"{f['pp']} {lay['pp']}")
    if lay["vpp"]:
        out.append(f"{f['pp_virtual_stage_layers']} {lay['vpp']}")
    if lay["ep"] > 1:
        out.append(f"{f['ep']} {lay['ep']}")
    out.append(f"{f['micro_batch_size']} {lay['micro_batch_size']}")
    out += [f"{f[name]} {value}" for name, value in RECOMPUTE[lay["recompute"]].items()]
    if lay["distributed_optimizer"]:
        out.append("--use-distributed-optimizer")
    return " ".join(out)


def tokens_per_sample(spec, plan) -> int:
    """Tokens of one sample: the first input's elements over the micro-batch size."""
    shape = spec.inputs[0].shape if spec.inputs else (plan.settings.micro_batch_size,)
    n = 1
    for d in shape:
        n *= d
    return n // plan.settings.micro_batch_size


def _divisors(n: int) -> list:
    return [d for d in range(1, n + 1) if n % d == 0]


def search(path: str, base, overrides, machine, num_gpus: int, global_batch_size: int,
           fixed: Fixed = Fixed(), overlap_param_gather: bool = False,
           micro_batch_sizes: tuple = MICRO_BATCH_SIZES) -> Result:
    """Every layout, pruned and ranked; `base` holds the settings the search does not vary
    (dtype, backend, fuse)."""
    if num_gpus < 1 or global_batch_size < 1:
        flag, value = ("--num-gpus", num_gpus) if num_gpus < 1 else ("--global-batch-size", global_batch_size)
        raise SpecError(Loc(f"{flag} {value}"), "must be at least 1")
    start, cpu = time.perf_counter(), time.process_time()
    res = Result([])

    def choices(name, default):
        value = getattr(fixed, name)
        return default if value is None else [value]

    dpn = machine.devices_per_node
    tps = choices("tp", [t for t in _divisors(dpn) if num_gpus % t == 0])
    experts = None  # whether the spec has expert weights: known after the first compile
    params_seen = 0  # the most parameters one rank of a compiled layout holds: at most the model's
    compiled: dict = {}

    def compile_key(key):
        if key not in compiled:
            tp, sp, cp, cpct, ep, mbs, rc = key
            recompute = {**dict.fromkeys(Settings.names("recompute")), **RECOMPUTE[rc]}
            settings = dataclasses.replace(base, tp=tp, sp=sp, cp=cp, cp_comm_type=cpct, ep=ep, micro_batch_size=mbs,
                                           pp=1, pp_virtual_stage_layers=None, pp_first_stage_layers=None,
                                           pp_last_stage_layers=None, pp_layout=None, **recompute)
            try:
                spec, graph = load_and_compile(path, settings, overrides, plan_only=True)
                raw = plan_entries(graph)
                blocks = [s for s in graph.repeats if "." not in s]
                compiled[key] = (spec, graph, raw, settings, graph.repeats[blocks[0]] if len(blocks) == 1 else None,
                                 assemble_plan(graph, raw, settings))
            except SpecError as e:
                compiled[key] = e
            res.compiled += 1
        return compiled[key]

    for tp in tps:
        for sp in choices("sp", [False, True] if tp > 1 else [False]):
            if sp and tp == 1:
                continue
            for cp in choices("cp", _divisors(num_gpus // tp) if num_gpus % tp == 0 else [1]):
                for cpct in choices("cp_comm_type", ["p2p", "all_gather"] if cp > 1 else ["auto"]):
                    if cp == 1 and cpct != "auto":
                        continue
                    rest = num_gpus // (tp * cp) if num_gpus % (tp * cp) == 0 else 0
                    for ep in choices("ep", _divisors(rest) if rest else [1]):
                        for mbs in choices("micro_batch_size", list(micro_batch_sizes)):
                            for rc in choices("recompute", list(RECOMPUTE)):
                                lay = {"tp": tp, "sp": sp, "cp": cp, "cp_comm_type": cpct, "ep": ep,
                                       "micro_batch_size": mbs, "recompute": rc}
                                if ep > 1 and experts is False:
                                    res.prune("the spec has no expert weights to split over expert-parallel "
                                              "ranks", lay)
                                    continue
                                if ep > 1 and cp > 1:
                                    res.prune("expert parallelism with context parallelism is not supported",
                                              lay)
                                    continue
                                pps = [p for p in choices("pp", _divisors(rest))
                                       if rest and rest % p == 0 and (rest // p) % ep == 0]
                                if not pps:
                                    res.prune("the GPU count does not divide into tp x cp x pp x dp with ep "
                                              "inside dp", lay)
                                    continue
                                if not any(global_batch_size % (mbs * (rest // p)) == 0 for p in pps):
                                    res.prune("the global batch is not a multiple of micro-batch size x dp",
                                              lay, len(pps))
                                    continue
                                floor = _state_floor(params_seen, tp, ep, pps, rest, base.dtype, machine, fixed)
                                if floor > machine.memory_bytes:
                                    res.prune(f"does not fit in {human_bytes(machine.memory_bytes)} per GPU: the "
                                              "weights, gradients and Adam state alone, at every pipeline size "
                                              "(not compiled)", lay, len(pps))
                                    if res.floor_misfit is None or floor < res.floor_misfit[0]:
                                        res.floor_misfit = (floor, {**lay, "pp": max(pps)})
                                    continue
                                got = compile_key((tp, sp, cp, cpct, ep, mbs, rc))
                                if isinstance(got, SpecError):
                                    res.prune(f"the model refuses it: {got.what}", lay, len(pps))
                                    continue
                                if experts is None and ep == 1:
                                    experts = bool(got[5].totals.get("expert_parameters"))
                                params_seen = max(params_seen, got[5].totals["parameters"])
                                _pipelines(res, got, lay, pps, rest, machine, num_gpus, global_batch_size,
                                           fixed, overlap_param_gather)
    res.candidates.sort(key=lambda c: (c[0]["step_time_s"], _order(c[1])))
    res.seconds = time.perf_counter() - start
    res.cpu_seconds = time.process_time() - cpu
    return res


def _state_floor(params: int, tp: int, ep: int, pps: list, rest: int, dtype: str, machine, fixed) -> float:
    """A lower bound on the bytes per GPU of every layout of a compile key, before compiling it:
    the fullest rank holds at least its share of the parameters (the model's, at least `params`,
    over tp x pp, and x ep for expert weights, counted as if all were), each with its weight,
    fp32 gradient and Adam state (over DP with the distributed optimizer), plus the framework's
    allowance; activations add to it. Layouts above it cannot fit: no need to compile them."""
    if not params:
        return 0.0
    dist_ok = fixed.distributed_optimizer is not False
    best = float("inf")
    for pp in pps:
        dp = rest // pp
        per = DTYPE_BYTES[dtype] + 4 + OPT_BYTES[dtype] / (dp if dist_ok else 1)
        best = min(best, params / (tp * pp * ep) * per)
    return best + machine.framework_memory_bytes


def _order(lay: dict) -> tuple:
    return tuple(str(lay[k]) if isinstance(lay[k], str) or lay[k] is None else (0, lay[k]) for k in SHORT)


def _pipelines(res, got, lay, pps, rest, machine, num_gpus, batch, fixed, overlap_param_gather) -> None:
    """Every PP (and virtual-stage) cut of one compiled graph, every DP-side choice of each."""
    spec, graph, raw, settings, n_layers, unpipelined = got
    for pp in pps:
        dp = rest // pp
        lay_pp = {**lay, "pp": pp, "dp": dp}
        mbs = lay["micro_batch_size"]
        if batch % (mbs * dp):
            res.prune("the global batch is not a multiple of micro-batch size x dp", lay_pp)
            continue
        m = batch // (mbs * dp)
        if pp > 1 and n_layers is None:
            res.prune("pipeline parallelism needs one repeated block at the spec's root", lay_pp)
            continue
        if pp > 1 and n_layers < pp:
            res.prune("fewer layers than pipeline stages", lay_pp)
            continue
        virtuals = [None]
        if pp > 1:
            virtuals += [v for v in _divisors(n_layers // pp) if n_layers % (pp * v) == 0 and n_layers // (pp * v) > 1]
        if fixed.vpp is not None:
            virtuals = [fixed.vpp] if pp > 1 else []
        for vpp in virtuals:
            lay_v = {**lay_pp, "vpp": vpp}
            if vpp is not None and (n_layers % (pp * vpp) or n_layers // (pp * vpp) < 2):
                res.prune("the layers do not split into virtual stages of that size", lay_v)
                continue
            if vpp is not None and m % pp:
                res.prune("interleaving needs micro-batches per pipeline a multiple of pp", lay_v)
                continue
            if pp == 1:
                plan = unpipelined
            else:
                s = dataclasses.replace(settings, pp=pp, pp_virtual_stage_layers=vpp)
                try:
                    cut_pipeline(graph, s)
                except SpecError as e:
                    res.prune(f"the model refuses it: {e.what}", lay_v)
                    continue
                plan = assemble_plan(graph, raw, s, unpipelined)
            tokens = tokens_per_sample(spec, plan)
            for dist in [False, True] if dp > 1 else [False]:
                if fixed.distributed_optimizer is not None and dist != fixed.distributed_optimizer:
                    continue
                full = {**lay_v, "distributed_optimizer": dist}
                pred = predict(plan, tokens, machine, Job(num_gpus, batch, dist,
                                                          overlap_param_gather=overlap_param_gather and dist))
                res.evaluated += 1
                if not pred["memory"]["fits"]:
                    need = pred["memory"]["total"]
                    if res.smallest_misfit is None or need < res.smallest_misfit[0]:
                        res.smallest_misfit = (need, full)
                    res.prune(f"does not fit in {human_bytes(machine.memory_bytes)} per GPU", full)
                    continue
                res.candidates.append((pred, full))
    cut_pipeline(graph, dataclasses.replace(settings, pp=1))


def no_fit_error(res: Result, machine, num_gpus: int) -> SpecError:
    if res.smallest_misfit is None and res.floor_misfit is not None:
        need, lay = res.floor_misfit
        return SpecError(Loc(f"--machine {machine.source}"), f"no layout fits in {human_bytes(machine.memory_bytes)} "
                         f"per GPU: the smallest need is over {human_bytes(need)} per GPU ({layout_text(lay)}: "
                         "weights, gradients and Adam state alone)",
                         "use more GPUs, a smaller global batch, or a machine with more memory")
    if res.smallest_misfit is None:
        reasons = "; ".join(f"{n} {why}" for why, (n, _) in sorted(res.pruned.items(), key=lambda x: -x[1][0]))
        return SpecError(Loc(f"--num-gpus {num_gpus}"), f"no layout is legal on {num_gpus} GPUs: {reasons or 'none'}",
                         "change --num-gpus or --global-batch-size")
    need, lay = res.smallest_misfit
    return SpecError(Loc(f"--machine {machine.source}"), f"no layout fits in {human_bytes(machine.memory_bytes)} per "
                     f"GPU: the smallest need is {human_bytes(need)} per GPU ({layout_text(lay)})",
                     "use more GPUs, a smaller global batch, or a machine with more memory")


def _why(pred: dict, lay: dict, other) -> str:
    """What a candidate gains over the next one in the ranking: the settings that differ and the
    part of the step that shrinks most."""
    if other is None:
        return "the last one shown"
    opred, olay = other
    diff = [k for k in SHORT if lay[k] != olay[k]]
    gains = {k: opred["breakdown_s"].get(k, 0.0) - v for k, v in pred["breakdown_s"].items()}
    part = max(gains, key=lambda k: (gains[k], k))
    text = ", ".join(f"{k} {_short(olay[k])}" for k in diff)
    if gains[part] <= 0:
        return f"ties the next, which has {text}"
    return f"{gains[part]:.3g} s less {LABELS[part].split(' (')[0]} than the next, which has {text}"


def _short(v) -> str:
    return {True: "on", False: "off", None: "-"}.get(v, str(v)) if isinstance(v, (bool, type(None))) else str(v)


def ranked(res: Result, top: int) -> list:
    """The top candidates as plain data: settings under their short names, predicted figures,
    and why each beats the next."""
    out = []
    shown = res.candidates[:top] if top > 0 else res.candidates
    for i, (pred, lay) in enumerate(shown):
        nxt = res.candidates[i + 1] if i + 1 < len(res.candidates) else None
        out.append({"rank": i + 1, **{k: lay[k] for k in SHORT}, "vpp": pred["layout"]["vpp"],
                    "layers_per_virtual_stage": lay["vpp"],
                    "step_time_s": pred["step_time_s"], "tokens_per_s": pred["tokens_per_s"],
                    "tflops_per_gpu": pred["tflops_per_gpu"], "mfu": pred["mfu"],
                    "memory_bytes": pred["memory"]["total"], "binding": pred["binding"],
                    "why": _why(pred, lay, nxt), "flags": layout_flags(lay)})
    return out


def search_dict(res: Result, machine, num_gpus: int, batch: int, top: int) -> dict:
    return {"machine": machine.name, "num_gpus": num_gpus, "global_batch_size": batch,
            "evaluated": res.evaluated, "compiled": res.compiled, "fit": len(res.candidates),
            "pruned": [{"reason": why, "count": n, "example": ex}
                       for why, (n, ex) in sorted(res.pruned.items(), key=lambda x: (-x[1][0], x[0]))],
            "candidates": ranked(res, top)}


def search_text(res: Result, machine, spec_path: str, num_gpus: int, batch: int, top: int) -> str:
    rows = ranked(res, top)
    lines = [f"specc plan {spec_path} --search: {num_gpus} x {machine.device} ({machine.name}), global batch {batch}",
             f"  {res.evaluated} layouts predicted ({res.compiled} compiles), {len(res.candidates)} fit; "
             f"{sum(n for n, _ in res.pruned.values())} pruned", ""]
    head = (f"{'#':>3} {'tp':>3} {'sp':>3} {'cp':>7} {'pp':>3} {'vpp':>4} {'ep':>3} {'dp':>4} {'mbs':>4} "
            f"{'recomp':>9} {'dopt':>4} {'step s':>10} {'tokens/s':>11} {'TFLOP/s':>8} {'MFU':>6} {'memory':>10}")
    lines.append(head)
    for r in rows:
        cp = f"{r['cp']}" + (f" {r['cp_comm_type'][:2]}" if r["cp"] > 1 else "")
        lines.append(f"{r['rank']:>3} {r['tp']:>3} {_short(r['sp']):>3} {cp:>7} {r['pp']:>3} "
                     f"{(r['layers_per_virtual_stage'] or '-'):>4} {r['ep']:>3} {r['dp']:>4} "
                     f"{r['micro_batch_size']:>4} {r['recompute']:>9} {_short(r['distributed_optimizer']):>4} "
                     f"{r['step_time_s']:>10.4g} {r['tokens_per_s']:>11,.0f} {r['tflops_per_gpu']:>8.1f} "
                     f"{100 * r['mfu']:>5.1f}% {human_bytes(r['memory_bytes']):>10}")
        lines.append(f"      binds: {r['binding']}; wins: {r['why']}")
    if res.pruned:
        lines += ["", "pruned:"]
        for why, (n, ex) in sorted(res.pruned.items(), key=lambda x: (-x[1][0], x[0])):
            lines.append(f"  {n:>6}  {why} (e.g. {ex})")
    if rows:
        lines += ["", f"the best: specc plan {spec_path} {rows[0]['flags']} --machine {machine.source} "
                  f"--num-gpus {num_gpus} --global-batch-size {batch}",
                  "  (the same layout flags compile, train and verify it)"]
    return "\n".join(lines) + "\n"
