"""The runs of the resume test (test_resume_layouts.py): 4 iterations
of 4 micro-batches' worth of samples (micro-batch 2, global batch 8), dropout 0.1, a checkpoint
every 2, at one layout: LAYOUT is comma-separated `tp=N`, `cp=N`, `pp=N`, `ep=N`, `virtual=N`
(interleaved pipeline: layers per virtual stage) and `moe` (specs/gpt-moe-tiny.yaml: routed experts
with an auxiliary loss and a balancing bias; else gpt-tiny). At PP the model has 4 layers, so that
the interleaved schedule has two stages per rank. The tests run it on their gloo ranks through
`run_on_rank`, and as a script under torchrun (`--max-restarts`), one rank per process:

    python -m torch.distributed.run --standalone --nproc-per-node 2 --max-restarts 1 \
        resume_rank.py CORPUS RUN_DIR LAYOUT
"""

from __future__ import annotations

import io
import os
import sys

from train_helpers import GPT_TINY, tiny_config

DROPOUT = {"hidden_dropout": 0.1, "attention_dropout": 0.1}
MOE_TINY = os.path.join(os.path.dirname(os.path.abspath(__file__)), "specs", "gpt-moe-tiny.yaml")


def parse_layout(layout: str) -> dict:
    """'tp=2,cp=2' -> {'tp': 2, 'cp': 2}; 'moe' -> {'moe': True}."""
    out = {}
    for item in filter(None, layout.split(",")):
        key, _, value = item.partition("=")
        out[key] = int(value) if value else True
    return out


def resume_config(world: int, data: str, run_dir: str, save: str, load, layout: str):
    lay = parse_layout(layout)
    overrides = dict(DROPOUT, **({"num_layers": 4} if lay.get("pp", 1) > 1 else {}))
    cfg = tiny_config(world, data, tp=lay.get("tp", 1), cp=lay.get("cp", 1), pp=lay.get("pp", 1),
                      ep=lay.get("ep", 1), spec=MOE_TINY if lay.get("moe") else GPT_TINY, mbs=2, gbs=8,
                      train_iters=4, eval_iters=0, overrides=overrides)
    cfg.parallel.pp_virtual_stage_layers = lay.get("virtual")
    cfg.parallel.dp = 1  # derived again inside run
    cfg.logging.run_dir, cfg.logging.progress = run_dir, False
    cfg.logging.peak_tflops = 1.0  # given: no peak measured (a quarter second of matrix multiplies per start)
    cfg.checkpoint.save, cfg.checkpoint.save_interval, cfg.checkpoint.load = save, 2, load
    return cfg


def run_on_rank(rank, world, data, run_dir, save, load, layout):
    """(exit code, log) of the run on a gloo rank of the test's pool."""
    from specc_torch.train import run

    os.environ.update(WORLD_SIZE=str(world), RANK=str(rank), LOCAL_RANK=str(rank))
    try:
        log = io.StringIO()
        return run(resume_config(world, data, run_dir, save, load, layout), stream=log), log.getvalue()
    finally:
        for key in ("WORLD_SIZE", "RANK", "LOCAL_RANK"):
            os.environ.pop(key, None)


if __name__ == "__main__":
    import torch

    from specc_torch.train import run

    torch.set_num_threads(1)  # as the gloo ranks: the same sums in the same order
    corpus, run_dir, layout = sys.argv[1], sys.argv[2], sys.argv[3]
    sys.exit(run(resume_config(int(os.environ["WORLD_SIZE"]), corpus, run_dir, run_dir + "/ckpt", None, layout)))
