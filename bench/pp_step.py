"""Pipeline parallelism: measured training-step time at PP = 2 and 4 (1F1B and interleaved, V=2)
and m micro-batches, beside the plan's bubble (P - 1) / (V·m + P - 1), against PP=1 on the same
global batch, in one run.

A step is forward and backward of a global batch of m samples (micro-batch size 1) and
finalize_model_grads (no optimizer step, which PP does not change). PP=1 runs the m micro-batches
one after another on one rank (gradient accumulation); PP=P runs them through the runtime's own
driver (runtime.pipeline.Pipeline: torch.distributed.pipelining's Schedule1F1B /
ScheduleInterleaved1F1B) on P gloo ranks, one thread each. The predicted bubble is the plan's
(`totals.pipeline.bubble[m]` of the model compiled at that PP); measured efficiency is
t(PP=1) / (P · t(PP=P)), what the P ranks achieve of a perfect P-fold split, read beside 1 − bubble
(the rest is p2p and schedule overhead, and the ranks sharing cores). Median of the timed steps,
the slowest rank's.

    python bench/pp_step.py [--steps 3] [--hidden 128 --layers 8 --heads 4 --seq 128 --vocab 1024] [--no-write]
"""

from __future__ import annotations

import argparse
import datetime
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from train_step import (  # noqa: E402
    add_model_arguments,
    gemm_peak_gflops,
    machine_line,
    make_batches,
    mfu,
    overrides,
    plan_flops,
    run_ranks,
)

import runtime  # noqa: E402
import specc_torch  # noqa: E402

SPEC = os.path.join(ROOT, "specs", "gpt.yaml")
HEADING = "## Pipeline parallelism: PP=2, 4 vs PP=1"
MICRO = (4, 8)
SCHEDULES = ((1, "1F1B"), (2, "interleaved"))  # (V, name)


def _per_stage(cfg, pp: int, virtual: int):
    return None if virtual == 1 else cfg.layers // (pp * virtual)


def plan_bubble(cfg, pp: int, virtual: int, m: int) -> float:
    """The plan's bubble fraction at m micro-batches for the model compiled at this PP (and V)."""
    from specc.plan.build import build_plan
    from specc.settings import Settings

    settings = Settings(pp=pp, pp_virtual_stage_layers=_per_stage(cfg, pp, virtual), dtype="fp32")
    _, _, graph = specc_torch.compile_source(SPEC, settings, overrides(cfg))
    return build_plan(graph).totals["pipeline"]["bubble"][str(m)]


def _micro(cfg, m: int):
    """Global batches of m samples as m micro-batches of one."""
    c = argparse.Namespace(**{**vars(cfg), "batch": m})
    return [[tuple(t[i:i + 1] for t in batch) for i in range(m)] for batch in make_batches(c)]


def bench_pp1(cfg, m: int) -> float:
    torch.set_num_threads(1)
    pg = runtime.ProcessGroups.single()
    model = specc_torch.build_model(SPEC, pg, seed=cfg.seed, overrides=overrides(cfg), micro_batch_size=1)
    params = list(model.parameters())
    batches = _micro(cfg, m)

    def step(micro):
        for p in params:
            p.grad = None
        start = time.perf_counter()
        for mb in micro:
            (model(*mb).mean() / m).backward()
        runtime.finalize_model_grads(model, pg)
        return time.perf_counter() - start

    step(batches[0])
    return statistics.median(step(batches[(i + 1) % len(batches)]) for i in range(cfg.steps))


def _pp_rank(rank, world, cfg):
    from runtime.ddp import DistributedDataParallel
    from runtime.pipeline import Pipeline

    pg = runtime.ProcessGroups.initialize(pp=world)
    out = {}
    for virtual, _ in SCHEDULES:
        model = specc_torch.build_model(SPEC, pg, seed=cfg.seed, overrides=overrides(cfg), micro_batch_size=1,
                                        pp=world, pp_virtual_stage_layers=_per_stage(cfg, world, virtual))
        ddp = DistributedDataParallel(model, pg)
        for m in MICRO:
            pipe = Pipeline(model, pg, m, ("tokens", "labels"))
            batches = _micro(cfg, m)

            def step(micro):
                ddp.zero_grad_buffer()
                dist.barrier()
                start = time.perf_counter()
                with ddp.no_sync():
                    pipe.step(micro)
                runtime.finalize_model_grads(model, pg, ddp)
                return time.perf_counter() - start

            step(batches[0])
            out[(virtual, m)] = [step(batches[(i + 1) % len(batches)]) for i in range(cfg.steps)]
    pg.destroy()
    return out


def bench_pp(cfg, world: int) -> dict:
    got = run_ranks(_pp_rank, world, cfg, what=f"PP={world}")
    # a step ends when every rank's does: the slowest rank's time per step, then the median
    return {key: statistics.median(max(got[r][key][i] for r in got) for i in range(cfg.steps)) for key in got[0]}


def table(rows, peak) -> str:
    lines = ["| PP | schedule | m | step time | MFU | plan bubble | 1 − bubble | measured efficiency t1/(P·tP) |",
             "|---:|---|---:|---:|---:|---:|---:|---:|"]
    for pp, name, m, t, flops, bubble, t1 in rows:
        if pp == 1:
            lines.append(f"| 1 | — | {m} | {t * 1e3:.0f} ms | {mfu(flops, t, peak) * 100:.1f}% | 0 | 1 | 1 |")
        else:
            lines.append(f"| {pp} | {name} | {m} | {t * 1e3:.0f} ms | {mfu(flops, t, peak, pp) * 100:.1f}% | "
                         f"{bubble:.3f} | {1 - bubble:.3f} | {t1 / (pp * t):.3f} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_model_arguments(p, seq=128, batch=1)
    p.set_defaults(steps=3, hidden=128, layers=8, heads=4, vocab=1024)
    cfg = p.parse_args(argv)
    shape = (f"gpt.yaml at hidden {cfg.hidden}, {cfg.layers} layers, {cfg.heads} heads, seq {cfg.seq}, vocab "
             f"{cfg.vocab}, micro-batch 1, global batch m, fp32; {cfg.steps} timed steps each after 1 warm-up step")
    print(f"bench/pp_step.py: {shape}", flush=True)
    start = time.perf_counter()
    torch.set_num_threads(1)
    peak = gemm_peak_gflops()
    flops = {m: plan_flops(argparse.Namespace(**{**vars(cfg), "batch": m})) for m in MICRO}
    t1 = {m: bench_pp1(cfg, m) for m in MICRO}
    print("PP=1 done", flush=True)
    rows = [(1, "—", m, t1[m], flops[m], 0.0, t1[m]) for m in MICRO]
    for pp in (2, 4):
        measured = bench_pp(cfg, pp)
        print(f"PP={pp} done", flush=True)
        for virtual, name in SCHEDULES:
            for m in MICRO:
                rows.append((pp, name if virtual == 1 else f"{name} V={virtual}", m, measured[(virtual, m)],
                             flops[m], plan_bubble(cfg, pp, virtual, m), t1[m]))
    elapsed = time.perf_counter() - start
    text = table(rows, peak)
    print(text)
    if not cfg.no_write:
        write_section(cfg.output, shape, text, elapsed)
        print(f"wrote {cfg.output}")
    return 0


def write_section(path, shape, text, elapsed):
    """Replace this benchmark's section of docs/benchmarks.md (or append it); the rest stays."""
    section = SECTION.format(heading=HEADING, shape=shape, table=text, machine=machine_line(), elapsed=elapsed,
                             date=datetime.date.today().isoformat())
    with open(path, encoding="utf-8") as f:
        doc = f.read()
    at = doc.find(HEADING)
    if at < 0:
        doc = doc.rstrip("\n") + "\n\n" + section
    else:
        end = doc.find("\n## ", at + len(HEADING))
        doc = doc[:at] + section + (doc[end + 1:] if end >= 0 else "")
    with open(path, "w", encoding="utf-8") as f:
        f.write(doc)


SECTION = """{heading}

Measured by `python bench/pp_step.py` (written by it; rerun to refresh) on {date}:
{machine}; one thread per rank; the run took {elapsed:.0f} s.
Model: {shape}.

{table}

- **step time**: forward, backward and `finalize_model_grads` of a global batch of m samples;
  PP=1 accumulates the m micro-batches on one rank, PP=P runs them through `runtime.pipeline.Pipeline`
  (torch.distributed.pipelining's 1F1B / interleaved 1F1B) on P gloo ranks; median of the timed
  steps, the slowest rank's. MFU counts the P ranks' peak.
- **plan bubble**: `totals.pipeline.bubble[m]` of `specc plan` at that PP (and V), (P−1)/(V·m+P−1).
- **measured efficiency**: t(PP=1) / (P · t(PP=P)); a perfect pipeline with only the bubble would
  read 1 − bubble. Below it: p2p (gloo over loopback), the schedule's Python overhead per
  micro-batch and chunk, and P ranks sharing the machine's cores (this machine is shared and loaded:
  read the columns side by side, not as absolute numbers).
"""


if __name__ == "__main__":
    sys.exit(main())
