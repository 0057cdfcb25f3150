"""The run of test_resume_pipeline.py: gpt-tiny, 4 layers, dropout 0.1, PP = 2, 4 iterations of 4
micro-batches, a checkpoint every 2. The test runs it on its gloo ranks through `run_on_rank`, and
as a script under torchrun (`--max-restarts`), one rank per process:

    python -m torch.distributed.run --standalone --nproc-per-node 2 --max-restarts 1 \
        pp_resume_rank.py CORPUS RUN_DIR [--interleaved]
"""

from __future__ import annotations

import io
import os
import sys

from train_helpers import tiny_config

DROPOUT = {"hidden_dropout": 0.1, "attention_dropout": 0.1, "num_layers": 4}


def pp_resume_config(world: int, data: str, run_dir: str, save: str, load, virtual):
    cfg = tiny_config(world, data, pp=2, mbs=2, gbs=8, train_iters=4, eval_iters=0, overrides=dict(DROPOUT))
    cfg.parallel.pp_virtual_stage_layers = virtual
    cfg.parallel.dp = 1  # derived again inside run
    cfg.logging.run_dir, cfg.logging.progress = run_dir, False
    cfg.logging.peak_tflops = 1.0  # given: no peak measured (a quarter second of matrix multiplies per start)
    cfg.checkpoint.save, cfg.checkpoint.save_interval, cfg.checkpoint.load = save, 2, load
    return cfg


def run_on_rank(rank, world, data, run_dir, save, load, virtual):
    """(exit code, log) of the run on a gloo rank of the test's pool."""
    from specc_torch.train import run

    os.environ.update(WORLD_SIZE=str(world), RANK=str(rank), LOCAL_RANK=str(rank))
    try:
        log = io.StringIO()
        return run(pp_resume_config(world, data, run_dir, save, load, virtual), stream=log), log.getvalue()
    finally:
        for key in ("WORLD_SIZE", "RANK", "LOCAL_RANK"):
            os.environ.pop(key, None)


if __name__ == "__main__":
    import torch

    from specc_torch.train import run

    torch.set_num_threads(1)  # as the gloo ranks: the same sums in the same order
    corpus, run_dir = sys.argv[1], sys.argv[2]
    virtual = 1 if "--interleaved" in sys.argv[3:] else None
    sys.exit(run(pp_resume_config(int(os.environ["WORLD_SIZE"]), corpus, run_dir, run_dir + "/ckpt", None, virtual)))
