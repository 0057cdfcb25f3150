"""Does `specc plan --search` pick the layouts of Narayanan et al. 2021 Table 1? For each of the ten
rows (../shared/data/megatron_table1.csv: model, GPUs, global batch) the search runs on
dgx-a100-80gb over the layouts the paper's runtime offered, and the paper's own layout (TP, PP,
layers per virtual stage, micro-batch size, from Megatron-LM's examples/sc21/run_table_1.sh) is
looked up among the ranked candidates: its predicted step beside the search's best, and whether
it is the best or within 5% of it (issue 25's target: at least 8 rows).

The space searched is the paper's: TP (dividing a node's 8 GPUs), PP, interleaved virtual
stages, micro-batch size 1 to 16 and DP, with what every Table 1 run fixed held fixed: fp16, full
recompute of every layer (uniform, 1), dropout 0.1, the unfused attention of the time, no sequence
parallelism, no context parallelism and no distributed optimizer (none existed in the paper's
runtime; with them the search's best is another layout family altogether). The search places a
plain pipeline's layers by its cost model; the paper split them evenly.

    python bench/plan_table1_search.py [--rows 1.7,18.4] [--write-doc]
"""

from __future__ import annotations

import argparse
import csv
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from specc.compiler import load_and_compile  # noqa: E402
from specc.errors import Loc  # noqa: E402
from specc.frontend.model import Settings  # noqa: E402
from specc.plan import build_plan  # noqa: E402
from specc.plan.machine import load_machine  # noqa: E402
from specc.plan.search import Fixed, layout_text, search  # noqa: E402
from specc.plan.time import Job, predict  # noqa: E402

SPEC = os.path.join(ROOT, "specs", "gpt.yaml")
TABLE1 = os.path.join(ROOT, "..", "shared", "data", "megatron_table1.csv")
# examples/sc21/run_table_1.sh: micro-batch size and layers per virtual stage of each row
MICRO_BATCH = {"1.7": 16, "3.6": 16, "7.5": 16, "18.4": 8, "39.1": 4, "76.1": 2, "145.6": 2, "310.1": 1,
               "529.6": 1, "1008": 1}
VIRTUAL_STAGE_LAYERS = {"76.1": 5, "145.6": 5, "310.1": 3, "529.6": 1}
PAPERS_SPACE = Fixed(sp=False, cp=1, recompute="full", distributed_optimizer=False)
WITHIN = 0.05
SHORT_PART = {"memory_bound": "memory-bound", "tp_comm": "TP all-reduce", "pp_comm": "PP sends",
              "pipeline_bubble": "bubble", "dp_grad_reduce": "DP reduction", "compute": "GEMMs",
              "tied_embedding_sync": "tied embedding", "optimizer": "optimizer"}


def rows() -> list:
    with open(TABLE1, encoding="utf-8") as f:
        return list(csv.DictReader(line for line in f if not line.startswith("#")))


def overrides(row) -> list:
    return [(k, v, Loc("--set")) for k, v in (
        ("hidden_size", int(row["hidden"])), ("num_layers", int(row["layers"])),
        ("num_attention_heads", int(row["heads"])), ("seq_length", 2048), ("vocab_size", 51200),
        ("hidden_dropout", 0.1), ("attention_dropout", 0.1),
        ("modules.SelfAttention.submodules.core_attention.impl", "unfused"))]


def one_row(row, machine) -> dict:
    size = row["params_b"]
    paper = {"tp": int(row["tp"]), "pp": int(row["pp"]), "vpp": VIRTUAL_STAGE_LAYERS.get(size),
             "micro_batch_size": MICRO_BATCH[size]}
    res = search(SPEC, Settings(dtype="fp16"), overrides(row), machine, int(row["gpus"]), int(row["batch"]),
                 PAPERS_SPACE)
    found = next(((i, pred) for i, (pred, lay) in enumerate(res.candidates)
                  if all(lay[k] == v for k, v in paper.items())), None)
    best_pred, best_lay = res.candidates[0]
    out = {"size": size, "gpus": int(row["gpus"]), "batch": int(row["batch"]), "paper": paper,
           "best": best_lay, "best_s": best_pred["step_time_s"], "best_tflops":
           best_pred["tflops_per_gpu_with_recompute"], "fit": len(res.candidates), "evaluated": res.evaluated,
           "cpu_s": res.cpu_seconds, "rank": None}
    if found:
        i, pred = found
        out.update(rank=i + 1, paper_s=pred["step_time_s"], paper_tflops=pred["tflops_per_gpu_with_recompute"],
                   gap=pred["step_time_s"] / best_pred["step_time_s"] - 1,
                   extra={k: pred["breakdown_s"].get(k, 0.0) - best_pred["breakdown_s"].get(k, 0.0)
                          for k in set(pred["breakdown_s"]) | set(best_pred["breakdown_s"])})
    return out


def paper_text(p: dict) -> str:
    return f"tp {p['tp']} pp {p['pp']}" + (f" vpp {p['vpp']} layers" if p["vpp"] else "") + \
        f" mbs {p['micro_batch_size']}"


def table(results: list) -> str:
    lines = ["| model | GPUs | batch | paper's layout | predicted s (TFLOP/s) | rank of fitting | search's best | "
             "predicted s (TFLOP/s) | paper's vs best | where the paper's layout spends more, s |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        best = layout_text({**r["best"], "sp": False, "recompute": "none"})
        if r["rank"] is None:
            paper_cols = "not among the fitting layouts | -"
            gap, extra = "-", "-"
        else:
            paper_cols = f"{r['paper_s']:.2f} ({r['paper_tflops']:.1f}) | {r['rank']} of {r['fit']}"
            gap = f"{100 * r['gap']:+.1f}%" + (" yes" if r["gap"] <= WITHIN else "")
            parts = sorted(((v, k) for k, v in r["extra"].items() if v > 0.005 * r["best_s"]), reverse=True)
            extra = ", ".join(f"{SHORT_PART.get(k, k)} {v:+.2f}" for v, k in parts[:3]) or "-"
        lines.append(f"| {r['size']}B | {r['gpus']} | {r['batch']} | {paper_text(r['paper'])} | {paper_cols} | "
                     f"{best} | {r['best_s']:.2f} ({r['best_tflops']:.1f}) | {gap} | {extra} |")
    return "\n".join(lines)


# The paper's Section 5.4 compares layouts on 64 GPUs (examples/sc21/run_figure_13/14/15.sh: micro-batch
# 1, full recompute): (hidden, heads, layers, what varies, global batches, the paper's finding)
FIGURES = [
    ("Figure 13", (20480, 128, 32), [(8, 8), (4, 16), (2, 32)], (32, 128),
     "TP x PP = 64: the highest throughput at TP 8 (a node), PP 8"),
    ("Figure 14", (3840, 32, 32), [(1, 2), (1, 4), (1, 8), (1, 16), (1, 32)], (32, 512),
     "TP 1, PP x DP = 64: throughput falls as PP grows"),
    ("Figure 15", (3840, 32, 32), [(2, 1), (4, 1), (8, 1)], (32, 128, 512),
     "PP 1, TP x DP = 64: throughput falls as TP grows"),
]


def figures(machine) -> list:
    """The model's TFLOP/s per GPU on the layouts of the paper's Figures 13-15, beside what the
    paper measured: a check of the trade-offs the search weighs (TP against PP and DP)."""
    lines = []
    for name, (h, heads, layers), layouts, batches, finding in FIGURES:
        for batch in batches:
            got = []
            for tp, pp in layouts:
                settings = Settings(tp=tp, pp=pp, micro_batch_size=1, dtype="fp16",
                                    pp_first_stage_layers=layers // pp if pp > 1 else None,
                                    recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
                row = {"hidden": h, "layers": layers, "heads": heads}
                spec, graph = load_and_compile(SPEC, settings, overrides(row), plan_only=True)
                pred = predict(build_plan(graph), 2048, machine, Job(64, batch))
                got.append(f"tp {tp} pp {pp}: {pred['tflops_per_gpu_with_recompute']:.1f}")
            lines.append(f"| {name} | {batch} | {'; '.join(got)} | {finding} |")
    return ["| figure | batch | predicted TFLOP/s per GPU | the paper's measurement |", "|---|---|---|---|"] + lines


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", default=None, help="comma-separated model sizes as in the CSV (default: all ten)")
    p.add_argument("--machine", default="dgx-a100-80gb")
    p.add_argument("--write-doc", action="store_true", help="put the table in docs/benchmarks.md")
    args = p.parse_args(argv)
    if not os.path.isfile(TABLE1):
        raise SystemExit(f"{TABLE1} is absent (the shared data folder beside the clone)")
    machine = load_machine(args.machine)
    want = set(args.rows.split(",")) if args.rows else None
    start = time.process_time()
    results = []
    for row in rows():
        if want and row["params_b"] not in want:
            continue
        r = one_row(row, machine)
        results.append(r)
        gap = "paper's layout does not fit" if r["rank"] is None else f"paper's {100 * r['gap']:+.1f}% (rank {r['rank']})"
        print(f"{r['size']:>6}B: {r['evaluated']} layouts, {r['fit']} fit, {r['cpu_s']:.0f} s CPU; {gap}",
              file=sys.stderr, flush=True)
    met = sum(1 for r in results if r["rank"] is not None and r["gap"] <= WITHIN)
    summary = (f"the paper's layout is the search's best or within {100 * WITHIN:.0f}% of it on {met} of "
               f"{len(results)} rows (target: at least 8 of 10); {time.process_time() - start:.0f} s CPU")
    text = table(results)
    figs = "\n".join(figures(machine)) if not want else ""
    print(text + "\n\n" + summary + ("\n\n" + figs if figs else ""))
    if args.write_doc:
        from benchdoc import replace_section

        replace_section(os.path.join(ROOT, "docs", "benchmarks.md"), "\n".join([
            "## Plan search against Narayanan et al. 2021 Table 1", "",
            f"`python bench/plan_table1_search.py`: `specc plan --search` on {args.machine} for each row's model, "
            "GPU count and global batch, over the paper's space (TP within a node, PP, virtual stages, "
            "micro-batch 1-16, DP; fp16, full recompute, no SP, CP or distributed optimizer, as every Table 1 run); "
            "the paper's layout located among the ranked layouts that fit. docs/planning.md discusses it.", "",
            text, "", summary + ".", "", "The trade-offs against the paper's own layout comparisons (Section 5.4, "
            "64 GPUs, micro-batch 1, full recompute; the same model, specs/gpt.yaml at each figure's sizes):", "",
            figs, ""]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
