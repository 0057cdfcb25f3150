"""The tables and text bench/megatron_step.py writes to docs/benchmarks.md: the model step and
each system's own training step side by side (`table`), specc's collectives per transport
(`comm_table`), and the section's prose around them."""

from __future__ import annotations

import statistics

from train_step import mfu

SETTINGS = {"tp1": (1, False), "tp2": (2, False), "tp2sp": (2, True)}
LABELS = {"tp1": "TP=1", "tp2": "TP=2 (2 ranks)", "tp2sp": "TP=2 + SP (2 ranks)"}


def table(cfg, results: dict, flops: float, ours: str = "specc", theirs: str = "megatron") -> str:
    """One row per setting: `ours` against `theirs` (the model step with the same torch AdamW, or
    each system's own training step); for the model step also specc on gloo (Megatron's transport)
    and specc with --torch-compile, against both."""
    compiled = cfg.torch_compile and ours == "specc"
    gloo = ours == "specc" and any("specc-gloo" in res["rounds"][0] for res in results.values())
    head = ("| setting | specc step (ms) | Megatron Core step (ms) | specc / Megatron | target | specc MFU | "
            "Megatron MFU | first-loss diff |")
    cols = head.count("|") - 1
    if gloo:
        head += " specc on gloo (ms) | on gloo / Megatron |"
        cols += 2
    if compiled:
        head += " specc+compile (ms) | compile / eager | compile / Megatron |"
        cols += 3
    lines = [head, "|" + "---|" * cols]
    for setting, res in results.items():
        names = [ours, theirs] + (["specc+compile"] if compiled else [])
        med = {n: statistics.median(r[n] for r in res["rounds"]) for n in names}
        ratio = statistics.median(r[ours] / r[theirs] for r in res["rounds"])
        tp = SETTINGS[setting][0]
        target = "< 1" if tp == 1 else "<= 0.85"
        met = ratio < 1 if tp == 1 else ratio <= 0.85
        # per round, against that round's peak (the machine drifts between rounds), then the median
        util = {n: statistics.median(mfu(flops, r[n], peak, tp) for r, peak in zip(res["rounds"], res["peaks"]))
                for n in med}
        diff = abs(res["first_loss"][ours] - res["first_loss"][theirs])
        line = (f"| {LABELS[setting]} | {med[ours] * 1e3:.1f} | {med[theirs] * 1e3:.1f} | **{ratio:.3f}** | "
                f"{target} {'met' if met else 'missed'} | {util[ours]:.1%} | {util[theirs]:.1%} | {diff:.1e} |")
        if gloo and "specc-gloo" in res["rounds"][0]:
            g = statistics.median(r["specc-gloo"] for r in res["rounds"])
            line += f" {g * 1e3:.1f} | {statistics.median(r['specc-gloo'] / r[theirs] for r in res['rounds']):.3f} |"
        elif gloo:
            line += " — | — |"
        if compiled:
            c = med["specc+compile"]
            line += f" {c * 1e3:.1f} | {c / med[ours]:.3f} | {c / med[theirs]:.3f} |"
        lines.append(line)
    return "\n".join(lines)


def comm_table(results: dict) -> str:
    lines = ["| setting | transport | collectives per step | MiB per rank | alone (ms) | waited in the step (ms) | "
             "hidden |", "|---|---|---|---|---|---|---|"]
    for setting, res in results.items():
        for name, c in (res["comm"] or {}).items():
            transport = "gloo" if name == "specc-gloo" else res["transport"]
            lines.append(f"| {LABELS[setting]} | {transport} | {c['count']} | {c['bytes'] / 2 ** 20:.1f} | "
                         f"{c['alone'] * 1e3:.1f} | {c['exposed'] * 1e3:.1f} | {1 - c['exposed'] / c['alone']:.0%} |")
    return "\n".join(lines) if len(lines) > 2 else ""


TITLE = "## Training step: specc vs Megatron Core"

DOC = """{title}

Measured by `python bench/megatron_step.py{args}` (after `bash bench/setup_megatron.sh`; written by it)
on {date}: {machine}; one thread per rank; the run took {elapsed:.0f} s.{load}
Model: {shape}. FLOPs per step (specc's plan): {flops:.3g}; fp32 GEMM peak measured per rank: {peak:.1f} GFLOP/s
(the median over rounds; each round's peak is read among its steps, and each round's MFU is against it).

**Model step** (both sides: zero_grad, forward, backward, gradient finalization, and the same
`torch.optim.AdamW(fused=True)`, torch's one-kernel AdamW, its fastest on the CPU): what the two
implementations of the model cost.

{table}
{own}{comm}
{matmul}- **specc / Megatron** = the median over {rounds} rounds of the per-round ratio of median step
  times; within a round the implementations alternate step by step, so load from other
  processes hits both alike.
- **Megatron Core**: 0.19.2, `GPTModel` with `get_gpt_layer_local_spec()` (no TE, no Apex) on gloo;
  with SP its torch LayerNorm is replaced through the spec by the same norm with parameters tagged
  `sequence_parallel`, whose gradients Megatron's own `_allreduce_non_tensor_model_parallel_grads`
  all-reduces; an explicit causal mask; its CUDA RNG-tracker calls routed to the CPU generator.
- **Transports**: specc moves its collectives through shared memory where every rank of a host
  has a core (`runtime/cpu/shared_memory.py`, the default `auto` of `ProcessGroups.initialize` and
  `--collective-transport`; {transport} in this run); Megatron Core issues its collectives on
  torch.distributed itself, gloo here. The *specc on gloo* columns run specc on gloo as well: the
  gap between the two specc columns is the transport, the rest is the implementation.
- **Host memory**: every rank keeps what a step frees for the next (`runtime.cpu.host_memory`, as
  `specc train --host-memory retain` does by default on the CPU): both sides run in the same rank
  processes and both are spared the page faults.
- **MFU** = FLOPs per step / step time / (GEMM peak x ranks), per round, the median over rounds.
  The peak is a 1024^3 fp32 GEMM at one thread, read between the round's steps; the model's own
  GEMM shapes run at the same rate within this machine's noise.
- **first-loss diff**: both start from the same weights (cut to Megatron's shards, QKV per head), so
  the first losses agree: it is the same function.
"""


COMM = """
**specc's collectives** in one model step (`runtime.comm.CommTimer`, the rank that waited
longest), on each transport: issued alone, one after another, against the time the step waits on
them (blocking calls, and the wait() of the async ones: the input-gradient all-reduce /
reduce-scatter runs during the weight-gradient GEMM, the sequence-parallel re-gather during the
input-gradient GEMM). "hidden" = 1 - waited / alone; it is negative when waiting also absorbs the
other rank being late, which is most of the wait once the collectives themselves are short.
Where every core runs a rank (2 ranks on 2 cores here) no core is free to move data while the
GEMMs run, so an async collective only takes turns with the GEMM it was to hide behind: what
shortens the step here is making the collectives cheap (shared memory: a copy into a mapped slot,
no socket round trip), not hiding them; hiding needs a spare core or a NIC/NVLink engine doing the
transfer (NCCL on GPUs).

{table}
"""

OWN = """
**Training step** as each system's own training loop runs it: specc's
`runtime.DistributedDataParallel`, `runtime.finalize_model_grads` and `runtime.optim.Adam` (flat
buffers, torch's fused AdamW kernel) against Megatron Core's `DistributedDataParallel`,
`finalize_model_grads` and `get_megatron_optimizer` (on the CPU, without TE or Apex, torch's
foreach AdamW under its `FP32Optimizer`); AdamW with weight decay 0.01 on matrices, no clipping,
on both sides.

{table}
"""


def transports(results: dict) -> str:
    used = sorted({res["transport"] for setting, res in results.items() if SETTINGS[setting][0] > 1})
    return "shared memory" if used == ["shared memory"] else ", ".join(used) or "no collectives"
