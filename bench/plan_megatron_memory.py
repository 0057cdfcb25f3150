"""specc plan's memory per GPU against Megatron's own estimate
(megatron/training/theoretical_memory_usage.py, run from a Megatron-LM checkout: bench/.megatron,
or --megatron PATH) on the GPT layouts of Narayanan et al. 2021 Table 1
(../shared/data/megatron_table1.csv). Megatron's formula models bf16 with sequence parallelism
and selective recompute (Korthikanti et al. 2022's 34 s b h / t bytes per layer), the first
pipeline stage, and 18 bytes a parameter (6 + 12 / DP with the distributed optimizer); the plan
is asked for the same: --sp, --recompute-granularity selective, bf16, dropout 0.1, the rows' TP,
PP, virtual stages and micro-batch sizes. Megatron's activations are what the layers keep for
backward, and so is the plan's `activations_kept`, compared with them; the plan's peak adds the
working set of one backward (`activations_working`: the loss's fp32 temporaries, a recomputed
region materialised again), which Megatron's formula does not count, shown beside. Prints both,
per part, and writes the table to docs/planning.md's section (between its markers) unless --no-doc.

    python bench/plan_megatron_memory.py [--megatron bench/.megatron] [--no-doc]
"""

from __future__ import annotations

import argparse
import csv
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from specc.compiler import load_and_compile  # noqa: E402
from specc.errors import Loc  # noqa: E402
from specc.frontend.model import Settings  # noqa: E402
from specc.plan import build_plan  # noqa: E402
from specc.plan.machine import load_machine  # noqa: E402
from specc.plan.search import tokens_per_sample  # noqa: E402
from specc.plan.time import Job, predict  # noqa: E402

TABLE1 = os.path.join(ROOT, "..", "shared", "data", "megatron_table1.csv")
MICRO_BATCH = {"1.7": 16, "3.6": 16, "7.5": 16, "18.4": 8, "39.1": 4, "76.1": 2, "145.6": 2, "310.1": 1,
               "529.6": 1, "1008": 1}
VIRTUAL_STAGE_LAYERS = {"76.1": 5, "145.6": 5, "310.1": 3, "529.6": 1}
BEGIN, END = "<!-- megatron-memory:begin -->", "<!-- megatron-memory:end -->"


class Args:
    """Megatron's args: what the formula reads, None for the features a GPT does not use."""

    def __init__(self, **kw):
        self.__dict__.update(kw)

    def __getattr__(self, name):
        return None


def megatron_formula(path: str) -> dict:
    src = os.path.join(path, "megatron", "training", "theoretical_memory_usage.py")
    text = open(src, encoding="utf-8").read()
    text = text.replace("from .utils import is_hybrid_model, print_rank_0",
                        "is_hybrid_model = lambda args: False\nprint_rank_0 = print")
    scope: dict = {"__name__": "theoretical_memory_usage"}
    exec(compile(text, src, "exec"), scope)  # noqa: S102 - Megatron's own file, read as it is
    return scope


def rows(path=TABLE1) -> list:
    with open(path, encoding="utf-8") as f:
        return list(csv.DictReader(line for line in f if not line.startswith("#")))


def compare(row, meg, machine) -> dict:
    size, tp, pp, layers = row["params_b"], int(row["tp"]), int(row["pp"]), int(row["layers"])
    h, heads, gpus, batch = int(row["hidden"]), int(row["heads"]), int(row["gpus"]), int(row["batch"])
    mbs, vpp_layers = MICRO_BATCH[size], VIRTUAL_STAGE_LAYERS.get(size)
    dp = gpus // (tp * pp)
    m = batch // (mbs * dp)
    settings = Settings(tp=tp, sp=tp > 1, pp=pp, micro_batch_size=mbs, dtype="bf16", pp_virtual_stage_layers=vpp_layers,
                        pp_first_stage_layers=layers // pp if pp > 1 and vpp_layers is None else None,
                        recompute_granularity="selective")
    overrides = [("hidden_size", h), ("num_layers", layers), ("num_attention_heads", heads), ("seq_length", 2048),
                 ("vocab_size", 51200), ("hidden_dropout", 0.1), ("attention_dropout", 0.1)]
    spec, graph = load_and_compile(os.path.join(ROOT, "specs", "gpt.yaml"), settings,
                                   [(k, v, Loc("--set")) for k, v in overrides], plan_only=True)
    plan = build_plan(graph)
    mem = predict(plan, tokens_per_sample(spec, plan), machine, Job(gpus, batch))["memory"]
    args = Args(kv_channels=h // heads, num_attention_heads=heads, hidden_size=h, ffn_hidden_size=4 * h,
                num_layers=layers, seq_length=2048, padded_vocab_size=51200, micro_batch_size=mbs,
                tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp, data_parallel_size=dp,
                world_size=gpus, expert_tensor_parallel_size=1, expert_model_parallel_size=1,
                virtual_pipeline_model_parallel_size=layers // (pp * vpp_layers) if vpp_layers else None,
                group_query_attention=False, swiglu=False, normalization="LayerNorm", add_bias_linear=True,
                untie_embeddings_and_output_weights=False, use_distributed_optimizer=False, sequence_parallel=tp > 1,
                moe_layer_freq=1)
    weights_opt = meg["compute_weight_and_optimizer_memory"](args)
    acts = meg["compute_activation_memory"](args, m)
    return {"size": size, "tp": tp, "pp": pp, "vpp": args.virtual_pipeline_model_parallel_size or 1, "m": m,
            "specc_weights_opt": mem["weights"] + mem["gradients"] + mem["optimizer"],
            "megatron_weights_opt": weights_opt, "specc_acts": mem["activations_kept"], "megatron_acts": acts,
            "specc_working": mem["activations_working"],
            "in_flight": mem["micro_batches_in_flight"], "rank": mem["pipeline_rank"]}


def table(results: list) -> str:
    gib = 2 ** 30
    lines = ["| model | TP | PP | V | m | weights + grads + Adam, GiB: specc / Megatron | diff | "
             "activations kept, GiB: specc / Megatron | diff | specc's micro-batches in flight | "
             "specc's working set of one backward, GiB | specc's activations at the peak, GiB |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        dw = r["specc_weights_opt"] / r["megatron_weights_opt"] - 1
        da = r["specc_acts"] / r["megatron_acts"] - 1
        lines.append(f"| {r['size']}B | {r['tp']} | {r['pp']} | {r['vpp']} | {r['m']} | "
                     f"{r['specc_weights_opt'] / gib:.2f} / {r['megatron_weights_opt'] / gib:.2f} | {100 * dw:+.2f}% | "
                     f"{r['specc_acts'] / gib:.2f} / {r['megatron_acts'] / gib:.2f} | {100 * da:+.1f}% | "
                     f"{r['in_flight']} | {r['specc_working'] / gib:.2f} | {(r['specc_acts'] + r['specc_working']) / gib:.2f} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--megatron", default=os.path.join(ROOT, "bench", ".megatron"))
    p.add_argument("--no-doc", action="store_true")
    args = p.parse_args(argv)
    meg = megatron_formula(args.megatron)
    machine = load_machine("dgx-a100-80gb")
    text = table([compare(row, meg, machine) for row in rows()])
    sys.stdout.write(text)
    if not args.no_doc:
        doc = os.path.join(ROOT, "docs", "planning.md")
        body = open(doc, encoding="utf-8").read()
        i, j = body.index(BEGIN) + len(BEGIN), body.index(END)
        with open(doc + ".tmp", "w", encoding="utf-8") as f:
            f.write(body[:i] + "\n" + text + body[j:])
        os.replace(doc + ".tmp", doc)
    return 0


if __name__ == "__main__":
    sys.exit(main())
