"""How fast `specc plan --search` goes: a 96-layer GPT (GPT-3 175B's sizes: hidden 12288, 96
heads, sequence 2048) on dgx-a100-80gb, every layout of --num-gpus GPUs at a global batch,
in process; prints layouts predicted, compiles, and candidates per minute of this process's CPU
time (the target: at least 1,000 a minute on one core) and of wall time (other jobs included).

    python bench/plan_search.py [--num-gpus 64] [--global-batch-size 512] [--tp 8] [--sp]
"""

from __future__ import annotations

import argparse
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from specc.errors import Loc  # noqa: E402
from specc.frontend.model import Settings  # noqa: E402
from specc.plan.machine import load_machine  # noqa: E402
from specc.plan.search import Fixed, search, search_text  # noqa: E402

SPEC = os.path.join(ROOT, "specs", "gpt.yaml")
GPT3 = [("num_layers", 96), ("hidden_size", 12288), ("num_attention_heads", 96), ("seq_length", 2048)]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--num-gpus", type=int, default=64)
    p.add_argument("--global-batch-size", type=int, default=512)
    p.add_argument("--tp", type=int, default=None, help="fix TP (default: searched)")
    p.add_argument("--sp", action="store_true", help="fix SP on")
    p.add_argument("--cp", type=int, default=None, help="fix CP (default: searched)")
    p.add_argument("--machine", default="dgx-a100-80gb")
    p.add_argument("--write-doc", action="store_true", help="put the result in docs/benchmarks.md")
    args = p.parse_args(argv)
    machine = load_machine(args.machine)
    fixed = Fixed(tp=args.tp, sp=True if args.sp else None, cp=args.cp)
    res = search(SPEC, Settings(), [(k, v, Loc("--set")) for k, v in GPT3], machine, args.num_gpus,
                 args.global_batch_size, fixed)
    text = search_text(res, machine, "specs/gpt.yaml (96 layers, h 12288)", args.num_gpus, args.global_batch_size, 5)
    summary = (f"{res.evaluated} layouts predicted, {res.compiled} compiles, {len(res.candidates)} fit; "
               f"{res.cpu_seconds:.1f} s CPU, {res.seconds:.1f} s wall\n"
               f"candidates/min: {60 * res.evaluated / res.cpu_seconds:,.0f} per CPU minute, "
               f"{60 * res.evaluated / res.seconds:,.0f} per wall minute")
    sys.stdout.write(text + "\n" + summary + "\n")
    if args.write_doc:
        import datetime

        from benchdoc import load_line, replace_section

        given = " ".join(a for a in (argv if argv is not None else sys.argv[1:]) if a != "--write-doc")
        when = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
        load = load_line()
        replace_section(os.path.join(ROOT, "docs", "benchmarks.md"), "\n".join([
            "## Plan search: candidates per minute", "",
            f"`{' '.join(['python bench/plan_search.py', given]).strip()}` ({when}, {load} after): "
            "`specc plan --search` in process on GPT-3 175B's sizes "
            "(96 layers), on one core (the CPU minute is this process's; the wall minute counts the other jobs "
            "sharing the machine). Target: at least 1,000 candidates a minute.", "", "```", text.rstrip(), "",
            summary, "```", ""]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
