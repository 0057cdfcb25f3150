"""A training rank under torchrun (2 ranks, TP=2): resumes from DIR's latest checkpoint if there
is one, trains to STEPS saving every 2 steps, and appends "attempt step loss" lines to LOG
(rank 0). With KILL=K, rank 1 of the first attempt SIGKILLs itself before step K.

    torchrun --nproc-per-node 2 --max-restarts 1 ckpt_elastic_worker.py DIR LOG STEPS KILL
"""

from __future__ import annotations

import datetime
import os
import signal
import sys

import torch
import torch.distributed as dist
from ckpt_helpers import GPT, loss_of

import runtime
import specc_torch
from runtime.checkpoint import ParamShard, latest_step, load_checkpoint, save_checkpoint
from runtime.parallel_state import ProcessGroups


def main() -> None:
    directory, log, steps, kill = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    torch.set_num_threads(1)
    # torchrun keeps one store across restarts: without a per-attempt prefix the restarted ranks
    # read the dead ranks' gloo addresses from the first attempt and fail to connect
    timeout = datetime.timedelta(seconds=60)
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                          timeout=timeout)
    dist.init_process_group("gloo", store=dist.PrefixStore(f"attempt_{attempt}", store),
                            rank=int(os.environ["RANK"]), world_size=int(os.environ["WORLD_SIZE"]), timeout=timeout)
    pg = ProcessGroups.initialize(tp=2)
    torch.manual_seed(5)
    rng = runtime.RNGTracker(5, pg.tp.rank)
    model = specc_torch.build_model(GPT, pg, seed=5, sp=True, rng_tracker=rng, overrides={"hidden_dropout": 0.1})
    params = dict(model.named_parameters())
    momentum = {n: torch.zeros_like(p) for n, p in params.items()}
    state = {"step": 0, "momentum": {n: ParamShard(n, m) for n, m in momentum.items()}}
    step, consumed = 0, 0
    if latest_step(directory) is not None:
        out = load_checkpoint(directory, model, pg, optimizer_state=state, rng_tracker=rng)
        step, consumed = out["optimizer_state"]["step"], out["data_state"]["consumed_samples"]
    while step < steps:
        if attempt == 0 and step + 1 == kill and dist.get_rank() == 1:
            os.kill(os.getpid(), signal.SIGKILL)
        loss = loss_of(model, consumed)
        loss.backward()
        runtime.finalize_model_grads(model, pg)
        with torch.no_grad():
            for n, p in params.items():
                momentum[n].mul_(0.9).add_(p.grad)
                p.sub_(0.05 * momentum[n])
                p.grad = None
        step, consumed = step + 1, consumed + 1
        if dist.get_rank() == 0:
            with open(log, "a") as f:
                f.write(f"{attempt} {step} {loss.item()!r}\n")
        if step % 2 == 0:
            save_checkpoint(directory, step, model, pg, rng_tracker=rng, keep_last=2,
                            optimizer_state={"step": step, "momentum": state["momentum"]},
                            data_state={"consumed_samples": consumed})
    pg.destroy()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
