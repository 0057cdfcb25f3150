"""`specc verify`: evidence that a compiled plan computes the same function as the unsharded
model. For each setting (TP size, sequence parallelism) the compiled model runs on gloo ranks
and is compared with the TP=1 model built from the same seed: the per-token loss at every step,
the logits, every parameter's gradient gathered to full shape, and the weights after K SGD
steps. The collectives the runtime really issued are counted and compared with the plan's.
Every comparison runs twice: from the initial weights, and from randomized ones (no zero biases,
no unit gains: runtime.init.randomize_parameters), where a bias or gain handled wrongly across
ranks shows. The model's inputs are drawn as the spec declares them (names, shapes, dtypes).
"""

from __future__ import annotations

import datetime
import math
import os
import queue
import socket
import time
import traceback
from dataclasses import replace

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from runtime.comm import CommCounter
from runtime.compile import compile_layers
from runtime.grads import finalize_model_grads
from runtime.init import gather_full, randomize_parameters, replica_mismatch
from runtime.parallel_state import ProcessGroups
from runtime.random import RNGTracker
from specc.settings import Settings

from . import api
from .verify_compare import _compare, _compare_named, _row, _statistical_row
from .verify_config import MUTATIONS, Row, VerifyConfig, mutate_source  # noqa: F401 (MUTATIONS: for the command line)
from .verify_graph import (
    _activation_sites,
    _capture,
    _data,
    _full_activation,
    _logits_module,
    _loss_and_returned,
    _model_inputs,
)


def _run(model, pg, cfg, inputs, logits_path, logits_site, sites, dp_batches: int = 1):
    """K training steps; what to compare, as full tensors on every rank. In data-parallel mode
    (cfg.data_parallel) this rank trains on its DP rank's batches and the gradients are averaged
    over DP (an expert weight's over its expert-data-parallel group, over which it is replicated);
    the single-rank reference (`dp_batches` > 1) runs every DP rank's batch and averages alike."""
    captured = {}
    if logits_path:
        module = model.get_submodule(logits_path)
        module.register_forward_hook(lambda m, i, o: captured.__setitem__("logits", o.detach()))
    # SGD, not Adam: Adam divides by sqrt(v) and so blows float noise in gradients that are zero in
    # exact arithmetic (the key bias: softmax ignores it) up to lr-sized steps on either side.
    # Written out (torch.optim.SGD's update without momentum: p -= lr * grad) because the first
    # torch.optim optimizer of a process imports torch._dynamo, seconds on every rank.
    params = list(model.parameters())
    losses, grads, counts, replicas = [], None, None, {}
    activations, returned = {}, []
    for step in range(cfg.steps):
        if dp_batches > 1:
            loss = _reference_step(model, cfg, inputs, step, dp_batches, sites, activations, captured)
            counter = CommCounter()
            store = {}
        else:
            batch = _data(cfg, inputs, step, pg.dp.rank if cfg.data_parallel else 0)
            store, handles = _capture(model, sites) if step == 0 else ({}, [])
            with CommCounter() as counter:
                loss, extra = _loss_and_returned(model(*batch))
                returned = extra if step == 0 else returned
                for h in handles:
                    h.remove()
                loss.mean().backward()
                finalize_model_grads(model, pg)
            if cfg.data_parallel:
                _average_over_dp(model, pg)
                loss = _gather_over_dp(loss, pg)
        layouts = dict(sites)
        for path, outs in store.items():
            calls = layouts[path]
            activations[path] = [_full_activation(o, calls[min(i, len(calls) - 1)], pg) for i, o in enumerate(outs)]
        if step == 0:
            counts = counter.totals()
            # a parameter without gradient (a MoE router's expert bias) has none to compare
            grads = {n: gather_full(p.grad, p, pg.tp, pg.ep) for n, p in model.named_parameters() if p.requires_grad}
            replicas = {n: replica_mismatch(p.grad, p, pg.tp) for n, p in model.named_parameters()
                        if p.grad is not None and p._specc_init.replicated_units()}
            logits = captured.get("logits")
            if logits is not None:
                logits = _full_activation(logits, logits_site, pg)
        losses.append(loss.detach().clone())
        with torch.no_grad():
            for p in params:
                if p.grad is not None:
                    p.add_(p.grad, alpha=-cfg.lr)
                    p.grad = None
    weights = {n: gather_full(p, p, pg.tp, pg.ep) for n, p in model.named_parameters()}
    for n, p in model.named_parameters():
        if p._specc_init.replicated_units():
            replicas[n + " (weight)"] = replica_mismatch(p, p, pg.tp)
    return {"loss": torch.stack(losses), "logits": logits, "grads": grads, "weights": weights, "counts": counts,
            "activations": activations, "returned": returned, "replicas": replicas}


def _reference_step(model, cfg, inputs, step, dp_batches, sites, activations, captured):
    """One step of the single-rank reference over every DP rank's batch: the gradient of the mean
    over DP of each batch's mean loss; the losses stacked as _gather_over_dp stacks them."""
    from runtime.moe import set_aux_loss_scale

    set_aux_loss_scale(model, 1.0 / dp_batches)  # each batch's auxiliary losses weigh as its LM loss
    losses = []
    for d in range(dp_batches):
        store, handles = _capture(model, sites) if step == 0 and d == 0 else ({}, [])
        loss, _ = _loss_and_returned(model(*_data(cfg, inputs, step, d)))
        for h in handles:
            h.remove()
        (loss.mean() / dp_batches).backward()
        for path, outs in store.items():
            activations[path] = [o.detach().clone() for o in outs]
        if d == 0 and "logits" in captured:
            captured["logits_0"] = captured["logits"]
        losses.append(loss.detach())
    if "logits_0" in captured:
        captured["logits"] = captured.pop("logits_0")
    return torch.cat(losses, dim=0)


def _average_over_dp(model, pg) -> None:
    """What DistributedDataParallel does to the gradients: the mean over the data-parallel ranks
    (dense weights: sum over dp / dp; expert weights: sum over their expert-data-parallel group
    / dp, since each EP rank's experts already hold the gradient of every token routed to them)."""
    from runtime.comm import all_reduce
    from runtime.moe import is_expert_param

    for p in model.parameters():
        if p.grad is None:
            continue
        all_reduce(p.grad, pg.edp if is_expert_param(p) else pg.dp)
        p.grad /= pg.dp.size


def _gather_over_dp(loss, pg):
    from runtime.mappings import gather_dim0

    return gather_dim0(loss.detach().contiguous(), pg.dp)


def _has_dropout(graph) -> bool:
    return any((op.kind == "dropout" and op.attrs["p"] > 0) or (op.kind == "core_attention" and op.attrs["dropout"] > 0)
               for op in graph.iter_ops())


def _mask_losses(model, cfg, inputs) -> torch.Tensor:
    """Per-token losses [draws, b, s] of one batch under `mask_draws` independent dropout masks."""
    batch = _data(cfg, inputs, 0)
    with torch.no_grad():
        return torch.stack([_loss_and_returned(model(*batch))[0] for _ in range(cfg.mask_draws)])


def _plan_counts(graph) -> dict:
    from specc.plan import build_plan

    totals = build_plan(graph).totals
    out = {k: (v["count"], v["bytes"]) for k, v in totals["collectives"].items() if v["count"]}
    sync = totals["grad_sync"]["all_reduce"]
    if sync["count"]:
        c, b = out.get("all_reduce", (0, 0))
        out["all_reduce"] = (c + sync["count"], b + sync["bytes"])
    return out


def _rank_main(rank: int, world: int, port: int, cfg: VerifyConfig, results) -> None:
    torch.set_num_threads(1)
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=120))
    try:
        rows = _verify_all(rank, cfg)
        results.put((rank, True, rows))
    except BaseException:
        results.put((rank, False, traceback.format_exc()))
    finally:
        dist.destroy_process_group()


# The weights each comparison starts from: the initial ones (every bias zero, every gain one), and
# randomized ones where a bias or gain handled wrongly across ranks shows. Prefix of the rows' quantity.
WEIGHTS = (("", False), ("random weights: ", True))


def _verify_all(rank: int, cfg: VerifyConfig) -> list:
    src, spec, graph = api.compile_source(cfg.spec, Settings(micro_batch_size=cfg.batch, dtype="fp32", **cfg.packed),
                                          cfg.overrides)
    inputs = _model_inputs(spec, graph)
    path, layout = _logits_module(graph)
    single = ProcessGroups.single()
    statistical = _has_dropout(graph) and not cfg.tp_invariant_dropout

    def build(source, name, pg, randomized, checked=True):
        tracker = RNGTracker(cfg.seed, pg.tp.rank, tp_invariant=cfg.tp_invariant_dropout, cp_rank=pg.cp.rank)
        model = api.load_module_from_source(source, name).build_model(pg, seed=cfg.seed, rng_tracker=tracker)
        if randomized:
            randomize_parameters(model, cfg.seed)
        if checked and cfg.torch_compile:
            compile_layers(model, cfg.torch_compile)
        return model

    refs = {}

    def reference(prefix, randomized, dp_batches):
        """The TP=1 model's results over `dp_batches` DP ranks' batches (1 unless data-parallel)."""
        if (prefix, dp_batches) not in refs:
            ref_model = build(src, spec.name, single, randomized, checked=False)
            refs[(prefix, dp_batches)] = _mask_losses(ref_model, cfg, inputs) if statistical else \
                _run(ref_model, single, cfg, inputs, path, layout, _activation_sites(graph), dp_batches)
        return refs[(prefix, dp_batches)]

    rows = []
    world = dist.get_world_size()
    for tp, cp, comm, sp, ep in _settings(cfg):
        setting = f"tp={tp}" + (f" cp={cp}" + (f" {comm}" if comm != "auto" else "") if cp > 1 else "") + \
            (f" ep={ep} dp={world // (tp * cp)}" if cfg.data_parallel else "") + f" sp={'on' if sp else 'off'}" \
            + _recompute_text(cfg.recompute)
        pg = ProcessGroups.initialize(tp=tp, cp=cp, ep=ep)
        dp_batches = pg.dp.size if cfg.data_parallel else 1
        try:
            text, spec_t, graph_t = api.compile_source(cfg.spec, Settings(
                tp=tp, sp=sp, cp=cp, cp_comm_type=comm, ep=ep, micro_batch_size=cfg.batch, dtype="fp32",
                **cfg.recompute, **cfg.packed), cfg.overrides)
            if cfg.mutate and tp * cp * ep > 1:
                text, applied = mutate_source(text, cfg.mutate)
                if not applied:
                    rows.append(Row(setting, f"mutation {cfg.mutate}", 0.0, 0.0, True, "nothing to break here; skipped"))
                    continue
            for prefix, randomized in WEIGHTS:
                model = build(text, spec_t.name, pg, randomized)
                if statistical:
                    got = _mask_losses(model, cfg, inputs)
                    if rank == 0:
                        row = _statistical_row(setting, reference(prefix, randomized, 1), got)
                        rows.append(replace(row, quantity=prefix + row.quantity))
                    continue
                path_t, layout_t = _logits_module(graph_t)
                got = _run(model, pg, cfg, inputs, path_t, layout_t, _activation_sites(graph_t))
                if rank != 0:
                    continue  # only rank 0 reports: the others skip the reference and the comparisons
                rows += [replace(r, quantity=prefix + r.quantity)
                         for r in _compare(setting, reference(prefix, randomized, dp_batches), got, cfg.tolerance,
                                           cfg.atol)]
                if randomized:
                    continue  # the collectives do not depend on the weights
                plan = _plan_counts(graph_t)
                measured = dict(sorted(got["counts"].items()))
                if "all_to_all" in measured and "all_to_all" in plan:
                    # how many tokens each expert gets depends on the routing: the plan's bytes are
                    # those of uniform routing, so the all-to-alls are compared by count
                    plan["all_to_all"] = (plan["all_to_all"][0], measured["all_to_all"][1])
                ok = measured == dict(sorted(plan.items()))
                rows.append(Row(setting, "collectives == plan", 0.0, 0.0, ok,
                                _counts_text(measured) + ("" if ok else f"  (plan: {_counts_text(plan)})")))
        finally:
            pg.destroy()
    if _pipeline_settings(cfg):
        rows += _verify_pipeline(cfg, reference, spec, inputs, build)
    return rows if rank == 0 else []


# -- pipeline parallelism ----------------------------------------------------------------------------

def _pipeline_settings(cfg: VerifyConfig) -> list:
    """(pp, layers per virtual stage, dp, tp, cp, sp) of every pipeline setting, in a fixed order;
    dp is the least asked for (the world may give a setting more: verify runs it on every rank)."""
    if cfg.pp_settings is not None:
        return [(pp, virtual, max(cfg.dps), tp, cp, sp) for pp, virtual, tp, cp, sp in cfg.pp_settings]
    out = []
    for pp in cfg.pps:
        if pp == 1:
            continue
        for virtual in cfg.pp_virtual:
            for cp in cfg.cps:
                for tp in cfg.tps:
                    for sp in (cfg.sps if tp > 1 else [False]):
                        out.append((pp, virtual, max(cfg.dps), tp, cp, sp))
    return out


def _verify_pipeline(cfg: VerifyConfig, reference, spec, inputs, build) -> list:
    """Each pipeline setting against the PP = 1 model: the mean loss at every step, every gradient
    (gathered over TP, collected over the stages; a weight tied across stages on both of its
    ends) and the weights after K SGD steps, from the initial and from randomized weights. The
    model runs as training does: runtime.ddp over DP (each DP rank its share of the batch), the
    stages driven by a torch.distributed.pipelining schedule over micro-batches of one sample."""
    rows = []
    names = [i.name for i in spec.inputs]
    for pp, virtual, dp, tp, cp, sp in _pipeline_settings(cfg):
        dp = dist.get_world_size() // (pp * tp * cp)  # every rank takes part: the rest replicate over DP
        setting = f"pp={pp}" + (f" vpp={virtual}" if virtual else "") + (f" dp={dp}" if dp > 1 else "") + \
            f" tp={tp}" + (f" cp={cp}" if cp > 1 else "") + f" sp={'on' if sp else 'off'}"
        if cfg.batch % dp or cfg.batch // dp < pp:
            raise ValueError(f"{setting}: --batch {cfg.batch} must split into DP={dp} shares of at least PP={pp} "
                             f"micro-batches (use --batch {dp * pp} or more)")
        pg = ProcessGroups.initialize(tp=tp, cp=cp, pp=pp, dp=dp)
        try:
            text, spec_t, _ = api.compile_source(cfg.spec, Settings(
                tp=tp, sp=sp, cp=cp, pp=pp, pp_virtual_stage_layers=virtual, dtype="fp32", **cfg.packed), cfg.overrides)
            for prefix, randomized in WEIGHTS:
                model = build(text, spec_t.name, pg, randomized)
                got = _run_pipeline(model, pg, cfg, names, inputs)
                if dist.get_rank() != 0:
                    continue  # only rank 0 reports
                ref = reference(prefix, randomized, 1)  # the PP=1 model on the whole batch
                want = {"loss": ref["loss"].double().mean(dim=tuple(range(1, ref["loss"].dim()))),
                        "grads": dict(ref["grads"]), "weights": dict(ref["weights"])}
                for what in ("grads", "weights"):
                    for key in got[what]:
                        if key.endswith(_COPY):
                            want[what][key] = want[what][key[:-len(_COPY)]]
                rows.append(replace(_row(setting, "loss (every step, mean)", got["loss"], want["loss"],
                                         cfg.tolerance, cfg.atol), quantity=prefix + "loss (every step, mean)"))
                for what, label in (("grads", "gradients (all params, all stages)"),
                                    ("weights", f"weights after {cfg.steps} SGD steps")):
                    rows.append(replace(_compare_named(setting, label, want[what], got[what], cfg.tolerance,
                                                       cfg.atol), quantity=prefix + label))
        finally:
            pg.destroy()
    return rows


_COPY = " (last stage's copy)"


def _run_pipeline(model, pg, cfg, names, inputs) -> dict:
    from runtime.ddp import DistributedDataParallel
    from runtime.init import init_name, is_tied_copy
    from runtime.pipeline import Pipeline

    ddp = DistributedDataParallel(model, pg)
    share = cfg.batch // pg.dp.size
    pipe = Pipeline(model, pg, share, names, schedule=cfg.pp_schedule, ddp=ddp)
    losses, grads = [], None
    for step in range(cfg.steps):
        batch = _data(cfg, inputs, step)
        mine = [t[pg.dp.rank * share:(pg.dp.rank + 1) * share] for t in batch]
        micro = [tuple(t[i:i + 1] for t in mine) for i in range(share)]
        ddp.zero_grad_buffer()
        with ddp.no_sync():
            loss = pipe.step(micro)
        finalize_model_grads(model, pg, ddp)
        if pg.dp.size > 1:
            comm_all_reduce(loss, pg.dp)
            loss /= pg.dp.size
        losses.append(loss.double().reshape(()))
        if step == 0:
            grads = _collect(model, pg, lambda p: p.main_grad, init_name, is_tied_copy, trainable=True)
        with torch.no_grad():
            for p in ddp.params:
                p.add_(p.main_grad, alpha=-cfg.lr)
    weights = _collect(model, pg, lambda p: p, init_name, is_tied_copy)
    return {"loss": torch.stack(losses), "grads": grads, "weights": weights}


def comm_all_reduce(t, group):
    from runtime.comm import all_reduce

    all_reduce(t, group)


def _collect(model, pg, what, init_name, is_tied_copy, trainable: bool = False) -> dict:
    """Full tensors of every parameter of every stage by (checkpoint) name, on every rank (only
    those with a gradient where `trainable`)."""
    mine = {}
    for name, p in model.named_parameters():
        if trainable and not p.requires_grad:
            continue
        key = init_name(name, p) + (_COPY if is_tied_copy(p) else "")
        mine[key] = gather_full(what(p).detach(), p, pg.tp)
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    out = {}
    for part in everyone:
        for key, t in part.items():
            out.setdefault(key, t)
    return dict(sorted(out.items()))


def _settings(cfg: VerifyConfig) -> list:
    """(tp, cp, cp comm type, sp, ep) of every setting to check, in a fixed order. Expert
    parallelism takes ep of the data-parallel ranks (the world fits every TP x EP, _world); it does
    not combine with context parallelism, so EP > 1 runs at CP = 1 only."""
    out = []
    world = _world(cfg)
    for cp in cfg.cps:
        for comm in (cfg.cp_comm_types if cp > 1 else ["auto"]):
            for tp in cfg.tps:
                for ep in cfg.eps:
                    if ep > 1 and (cp > 1 or world % (tp * cp * ep)):
                        continue
                    for sp in (cfg.sps if tp > 1 else [False]):
                        out.append((tp, cp, comm, sp, ep))
    return out


def _recompute_text(recompute: dict) -> str:
    granularity = recompute.get("recompute_granularity")
    if granularity is None:
        return ""
    if granularity == "selective":
        return " recompute=selective"
    return f" recompute=full/{recompute['recompute_method']}/{recompute['recompute_num_layers']}"


def _world(cfg: VerifyConfig) -> int:
    world = 1
    for cp in cfg.cps:
        for tp in cfg.tps:
            world = math.lcm(world, tp * cp)
    for ep in cfg.eps:  # expert parallelism runs without CP, over ep of each TP size's data-parallel ranks
        for tp in (cfg.tps if ep > 1 else [1]):
            world = math.lcm(world, tp * ep)
    for pp, _, dp, tp, cp, _ in _pipeline_settings(cfg):
        world = math.lcm(world, pp * dp * tp * cp)
    return world


def world_size(cfg: VerifyConfig) -> int:
    """Ranks every setting can run on: the least common multiple of the TP x CP and TP x EP sizes
    (every requested EP size runs with every requested TP size) and of each pipeline setting's
    PP x DP x TP x CP."""
    return _world(cfg)


def _counts_text(counts: dict) -> str:
    return ", ".join(f"{k} {c}x/{b}B" for k, (c, b) in sorted(counts.items())) or "none"


# -- the launcher ----------------------------------------------------------------------------------

def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def verify(cfg: VerifyConfig, timeout_s: float = 600) -> list:
    """Run every setting on max(tps) gloo ranks; the comparison rows (from rank 0)."""
    world = world_size(cfg)
    # forkserver, not spawn: the server imports torch and this module once, and every rank is a
    # fork of it (a fresh interpreter per rank spent seconds importing torch again, world times);
    # the server itself never runs a torch op, so its forks start clean (no threads, no state)
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload([__name__])
    results = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_rank_main, args=(r, world, port, cfg, results), daemon=True) for r in range(world)]
    for p in procs:
        p.start()
    rows, errors, reported = None, [], 0
    deadline = time.monotonic() + timeout_s
    try:
        while reported < world and not errors:
            try:
                rank, ok, payload = results.get(timeout=1.0)
            except queue.Empty:
                dead = [p for p in procs if p.exitcode not in (None, 0)]
                if dead:
                    errors.append(f"rank {procs.index(dead[0])} exited with code {dead[0].exitcode} before reporting")
                elif time.monotonic() > deadline:
                    errors.append(f"timed out after {timeout_s:.0f} s")
                continue
            reported += 1
            if not ok:  # the traceback's last line: the exception and its message
                last = [ln for ln in str(payload).strip().splitlines() if ln.strip()][-1:] or ["no message"]
                errors.append(f"rank {rank} failed: {last[0].strip()}")
            elif rank == 0:
                rows = payload
    finally:
        for p in procs:
            p.join(timeout=5 if not errors else 0.5)
            if p.is_alive():
                p.kill()
    if errors:
        raise RankFailure(errors[0])
    return rows


class RankFailure(RuntimeError):
    """A rank failed (or died, or timed out) inside verify: one line naming the rank and the error."""


def format_table(rows: list) -> str:
    header = ("setting", "quantity", "max abs err", "max rel err", "result", "detail")
    table = [header] + [(r.setting, r.quantity, f"{r.abs_err:.2e}", f"{r.rel_err:.2e}", "pass" if r.ok else "FAIL",
                         r.detail) for r in rows]
    widths = [max(len(t[i]) for t in table) for i in range(len(header) - 1)]
    return "\n".join(("  ".join(c.ljust(w) for c, w in zip(t, widths)) + "  " + t[-1]).rstrip() for t in table) + "\n"
