"""`specc plan --search` (specc/plan/search.py) against brute force: every layout of a small
space through the single-layout path (compile with the layout's settings, build_plan, predict)
gives the search's predictions, exactly, and the same ranking."""

from __future__ import annotations

import dataclasses
import json
import os

from specc.compiler import load_and_compile
from specc.errors import Loc, SpecError
from specc.frontend.model import Settings
from specc.plan import build_plan
from specc.plan.machine import load_machine
from specc.plan.search import RECOMPUTE, Fixed, layout_flags, search, tokens_per_sample
from specc.plan.time import Job, predict

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", ".."))
GPT_TINY = os.path.join(ROOT, "specs", "gpt-tiny.yaml")
OVERRIDES = [("num_layers", 4, Loc("--set"))]
# four GPUs a node, and a memory between what the layouts need: some fit, some do not
MACHINE = dataclasses.replace(load_machine("dgx-a100-80gb"), devices_per_node=4, framework_memory_bytes=0,
                              memory_bytes=1_500_000)


def brute_force(num_gpus: int, batch: int) -> list:
    """(step time, layout) of every layout of the space that compiles and fits, each compiled
    on its own."""
    out = []
    for tp in (1, 2, 4):
        for sp in ([False, True] if tp > 1 else [False]):
            for pp in (1, 2, 4):
                if num_gpus % (tp * pp):
                    continue
                dp = num_gpus // (tp * pp)
                for vpp in [None] + ([v for v in (1, 2) if 4 % (pp * v) == 0 and 4 // (pp * v) > 1] if pp > 1 else []):
                    for mbs in (2,):
                        if batch % (mbs * dp) or (vpp and (batch // (mbs * dp)) % pp):
                            continue
                        for rc, flags in RECOMPUTE.items():
                            s = Settings(tp=tp, sp=sp, pp=pp, pp_virtual_stage_layers=vpp, micro_batch_size=mbs, **flags)
                            try:
                                spec, graph = load_and_compile(GPT_TINY, s, OVERRIDES, plan_only=True)
                            except SpecError:
                                continue
                            plan = build_plan(graph)
                            for dist in ([False, True] if dp > 1 else [False]):
                                pred = predict(plan, tokens_per_sample(spec, plan), MACHINE, Job(num_gpus, batch, dist))
                                if pred["memory"]["fits"]:
                                    out.append((pred, (tp, sp, pp, vpp, mbs, rc, dist)))
    return out


def test_search_is_brute_force():
    res = search(GPT_TINY, Settings(), OVERRIDES, MACHINE, 4, 8, Fixed(cp=1), micro_batch_sizes=(2,))
    want = brute_force(4, 8)
    assert res.pruned and res.candidates and len(want) == len(res.candidates)
    assert any("does not fit" in why for why in res.pruned)
    got = {(lay["tp"], lay["sp"], lay["pp"], lay["vpp"], lay["micro_batch_size"], lay["recompute"],
            lay["distributed_optimizer"]): pred for pred, lay in res.candidates}
    for pred, key in want:
        assert got[key] == pred, key  # the whole prediction, exactly
    # the same ranking: by step time (ties by the layout, deterministically)
    assert [p["step_time_s"] for p, _ in res.candidates] == sorted(p["step_time_s"] for p, _ in want)
    assert res.compiled < len(want)  # one compile serves every pipeline cut and DP-side choice


def test_search_command_line(specc, tmp_path):
    profile = tmp_path / "small.yaml"
    text = open(os.path.join(ROOT, "specc", "plan", "machines", "dgx-a100-80gb.yaml"), encoding="utf-8").read()
    profile.write_text(text.replace("memory_bytes: 80.0e9", "memory_bytes: 1.0e5"))
    base = ["plan", GPT_TINY, "--search", "--num-gpus", "2", "--global-batch-size", "4", "--tp", "2",
            "--sp", "--micro-batch-size", "2"]
    code, out, err = specc(*base, "--machine", "dgx-a100-80gb", "--json", "--top", "3")
    assert code == 0, err
    out = json.loads(out)["search"]
    best = out["candidates"][0]
    assert [c["rank"] for c in out["candidates"]] == [1, 2, 3] and best["tp"] == 2 and best["sp"]
    for key in ("tp", "pp", "vpp", "cp", "ep", "dp", "micro_batch_size", "sp", "recompute", "distributed_optimizer",
                "step_time_s", "tflops_per_gpu", "why"):
        assert key in best
    # the best layout's flags give the same prediction through plain `specc plan --machine`
    code, one, err = specc("plan", GPT_TINY, *best["flags"].split(), "--machine", "dgx-a100-80gb", "--num-gpus",
                           "2", "--global-batch-size", "4", "--json")
    assert code == 0, err
    assert json.loads(one)["prediction"]["step_time_s"] == best["step_time_s"]
    code, out, err = specc(*base, "--machine", str(profile))
    assert code == 2 and out == "" and len(err.strip().splitlines()) == 1
    assert "no layout fits in 97.66 KiB per GPU: the smallest need is" in err and "tp 2" in err
    code, out, err = specc("plan", GPT_TINY, "--search", "--machine", "dgx-a100-80gb", "--num-gpus", "2")
    assert code == 2 and "needs --global-batch-size too" in err


def test_layout_flags_are_the_tables_and_a_fixed_pipeline_size_that_does_not_divide_is_pruned():
    """The flags of a layout (each setting's shortest flag in specc/settings.py) parse back to its
    settings; a --pp that does not divide what TP x CP leave of the GPUs is pruned, not a
    ZeroDivisionError (it was at tp 2 of 2 GPUs with --pp 4)."""
    lay = {"tp": 2, "sp": True, "cp": 2, "cp_comm_type": "p2p", "pp": 2, "vpp": 1, "ep": 1, "micro_batch_size": 2,
           "recompute": "full", "distributed_optimizer": True}
    assert layout_flags(lay) == ("--tp 2 --sp --cp 2 --cp-comm-type p2p --pp 2 --num-layers-per-virtual-pipeline-stage 1 "
                                 "--micro-batch-size 2 --recompute-granularity full --recompute-method uniform "
                                 "--recompute-num-layers 1 --use-distributed-optimizer")
    res = search(GPT_TINY, Settings(), OVERRIDES, MACHINE, 2, 8, Fixed(pp=4, cp=1, recompute="none"),
                 micro_batch_sizes=(2,))
    assert not res.candidates and res.evaluated == 0
    assert res.pruned["the GPU count does not divide into tp x cp x pp x dp with ep inside dp"][0] == 4  # tp 1 x ep 1, 2; tp 2 x sp
