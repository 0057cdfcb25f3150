"""Mixture of experts: step time of one MoE layer (runtime.MoELayer: router, dispatch, experts,
combine), measured in one run, for coarse (8 wide) and fine-grained (64 narrow) experts, for grouped experts (one torch.bmm per projection over the local
experts) vs a Python loop over the experts at EP=1, and EP=2 (two gloo ranks, each with half the
experts and its own tokens, tokens moved by all-to-all) vs EP=1, all with grouped experts.

A step is forward and backward of the layer on [seq, batch, hidden] tokens (loss: the output's
mean square). Every setting sees the same number of tokens per rank, so at EP=2 each rank's
expert GEMMs do the same FLOPs as at EP=1 on half the expert weights, plus the all-to-alls. The
median of the timed steps is reported, at EP=2 the slower rank's; MFU = the layer's matmul FLOPs
per rank (router, and fc1 + fc2 per routed token; backward twice the forward) over the measured
fp32 GEMM peak of one thread.

    python bench/moe_step.py [--steps 8 --hidden 256 --experts 8 --ffn 512 --topk 2 --fine 64,64,8 --seq 512 --batch 2]

Prints a table and writes it as its section of docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import datetime
import os
import statistics
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from benchdoc import replace_section  # noqa: E402
from train_step import gemm_peak_gflops, machine_line, mfu, run_ranks  # noqa: E402

import runtime  # noqa: E402
from runtime.init import init_parameters  # noqa: E402

HEADING = "## Mixture of experts: EP=2 vs EP=1, grouped vs looped experts"


def layer_flops(cfg) -> float:
    tokens = cfg.seq * cfg.batch
    forward = 2 * tokens * cfg.hidden * cfg.experts + 2 * tokens * cfg.topk * 3 * cfg.hidden * cfg.ffn
    return 3.0 * forward


def run(cfg, pg, grouped: bool, rank: int = 0):
    torch.set_num_threads(1)
    layer = runtime.MoELayer(cfg.hidden, cfg.experts, cfg.ffn, topk=cfg.topk, tp=pg.tp, ep=pg.ep, grouped=grouped,
                             aux_loss_coeff=0.01)
    init_parameters(layer, cfg.seed)
    g = torch.Generator().manual_seed(cfg.seed + rank)
    xs = [torch.randn(cfg.seq, cfg.batch, cfg.hidden, generator=g, requires_grad=True) for _ in range(2)]
    params = list(layer.parameters())

    def step(x):
        for p in params:
            p.grad = None
        start = time.perf_counter()
        layer(x).square().mean().backward()
        return time.perf_counter() - start

    step(xs[0])
    step(xs[1])
    return statistics.median(step(xs[i % 2]) for i in range(cfg.steps))


def _ep_rank(rank, world, cfg):
    pg = runtime.ProcessGroups.initialize(ep=world)
    out = run(cfg, pg, True, rank)
    pg.destroy()
    return out


def bench_ep(cfg, world: int) -> float:
    got = run_ranks(_ep_rank, world, cfg, what=f"EP={world}")
    return max(got.values())


def table(rows, peak) -> str:
    """rows: [(label, flops, looped s, grouped s, EP=2 s)]."""
    lines = ["| experts | EP=1 looped (ms, MFU) | EP=1 grouped (ms, MFU) | EP=2 grouped, 2 ranks (ms, MFU) | "
             "looped / grouped | EP=2 / EP=1 |", "|---|---|---|---|---|---|"]
    for label, flops, looped, grouped, ep2 in rows:
        lines.append(f"| {label} | {looped * 1e3:.1f}, {mfu(flops, looped, peak):.1%} | {grouped * 1e3:.1f}, "
                     f"{mfu(flops, grouped, peak):.1%} | {ep2 * 1e3:.1f}, {mfu(flops, ep2, peak):.1%} | "
                     f"**{looped / grouped:.3f}** | **{ep2 / grouped:.3f}** |")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--ffn", type=int, default=512)
    p.add_argument("--topk", type=int, default=2)
    p.add_argument("--seq", type=int, default=512)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--fine", default="64,64,8", metavar="E,FFN,K",
                   help="the fine-grained setting measured second (DeepSeek/Qwen-MoE style; default 64,64,8)")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--output", default=os.path.join(ROOT, "docs", "benchmarks.md"))
    p.add_argument("--no-write", action="store_true", help="print the table only")
    cfg = p.parse_args(argv)
    fine = [int(v) for v in cfg.fine.split(",")]
    shape = (f"one MoE layer, hidden {cfg.hidden}, SwiGLU experts, {cfg.seq} x {cfg.batch} tokens per rank, fp32, "
             f"dropless; {cfg.steps} timed steps after 2 warm-up steps; coarse: {cfg.experts} experts of width "
             f"{cfg.ffn}, top-{cfg.topk}; fine-grained: {fine[0]} of width {fine[1]}, top-{fine[2]}")
    print(f"bench/moe_step.py: {shape}", flush=True)
    start = time.perf_counter()
    torch.set_num_threads(1)
    peak = gemm_peak_gflops()
    single = runtime.ProcessGroups.single()
    rows = []
    for which in (cfg, argparse.Namespace(**{**vars(cfg), "experts": fine[0], "ffn": fine[1], "topk": fine[2]})):
        label = f"{which.experts} x {which.ffn}, top-{which.topk}"
        rows.append((label, layer_flops(which), run(which, single, False), run(which, single, True), bench_ep(which, 2)))
        print(f"{label} done", flush=True)
    text = table(rows, peak)
    print(text)
    if not cfg.no_write:
        write_section(cfg.output, shape, text, time.perf_counter() - start)
        print(f"wrote {cfg.output}")
    return 0


def write_section(path, shape, text, elapsed):
    """Replace this benchmark's section of docs/benchmarks.md (or append it); the rest stays."""
    replace_section(path, SECTION.format(heading=HEADING, shape=shape, table=text, machine=machine_line(),
                                         elapsed=elapsed, date=datetime.date.today().isoformat()))


SECTION = """{heading}

Measured by `python bench/moe_step.py` (written by it; rerun to refresh) on {date}:
{machine}; one thread per rank; the run took {elapsed:.0f} s.
Setting: {shape}.

{table}

- **grouped vs looped**: the same layer and tokens; grouped lays every local expert's rows into
  one zero-padded batch and runs each projection as one `torch.bmm`, looped runs two GEMMs per
  expert in a Python loop (`grouped_gemm: false`). With few wide experts the loop's GEMMs are
  large and the padding and gather copies cost the grouped path about as much as it saves; with
  many narrow experts (fine-grained) the loop's per-expert overhead dominates and one batched
  GEMM wins by a wide margin.
- **EP=2 vs EP=1**: each EP=2 rank holds half the experts and routes its own tokens (as many as
  the EP=1 rank), so its GEMM FLOPs are the same; the difference is the all-to-alls (counts,
  dispatch, combine forward; two backward) and the imbalance of the routing between the ranks.
  On this shared CPU with gloo the all-to-alls are memory copies through loopback sockets.
"""


if __name__ == "__main__":
    sys.exit(main())
