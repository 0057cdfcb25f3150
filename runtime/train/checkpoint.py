"""Checkpoints: DIR/iter_NNNNNNN/ holds the model (one file per TP rank, written by DP rank 0),
each rank's optimizer state (every DP rank with the distributed optimizer, DP rank 0 otherwise)
and RNG states, and meta.json; DIR/latest_checkpointed_iteration.txt names the newest. A
checkpoint is written into a temporary directory and renamed into place, so a crash mid-save
leaves the previous one intact. Loading needs the same TP size, DP size and optimizer kind."""

from __future__ import annotations

import json
import os
import shutil

import torch
import torch.distributed as dist

LATEST = "latest_checkpointed_iteration.txt"


def _barrier(pg) -> None:
    if pg.world_size > 1:
        dist.barrier()


def _rng_state(tracker) -> dict:
    return {"torch": torch.get_rng_state(), "tracker": tracker.get_states() if tracker is not None else None}


def save_checkpoint(directory: str, iteration: int, consumed_samples: int, setup, pg, config: dict) -> str:
    final = os.path.join(directory, f"iter_{iteration:07d}")
    tmp = final + ".tmp"
    if pg.rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(tmp)
    _barrier(pg)
    tp, dp = pg.tp.rank, pg.dp.rank
    if dp == 0:
        state = {k: v.detach().cpu().clone() for k, v in setup.model.state_dict().items()}
        torch.save(state, os.path.join(tmp, f"model_tp{tp:02d}.pt"))
    rank_state = {"rng": _rng_state(setup.rng_tracker)}
    if setup.optimizer.distributed or dp == 0:
        rank_state["optimizer"] = setup.optimizer.state_dict()
    torch.save(rank_state, os.path.join(tmp, f"rank_tp{tp:02d}_dp{dp:03d}.pt"))
    _barrier(pg)
    if pg.rank == 0:
        meta = {"iteration": iteration, "consumed_samples": consumed_samples, "tp": pg.tp.size, "dp": pg.dp.size,
                "distributed_optimizer": setup.optimizer.distributed, "config": config}
        with open(os.path.join(tmp, "meta.json"), "w", encoding="utf-8") as f:
            json.dump(meta, f, indent=1, default=str)
        if os.path.isdir(final):
            shutil.rmtree(final)
        os.replace(tmp, final)
        latest_tmp = os.path.join(directory, LATEST + ".tmp")
        with open(latest_tmp, "w") as f:
            f.write(f"{iteration}\n")
        os.replace(latest_tmp, os.path.join(directory, LATEST))
    _barrier(pg)
    return final


class CheckpointError(Exception):
    pass


def load_checkpoint(directory: str, setup, pg) -> tuple[int, int]:
    """Restore model, optimizer and RNG states; returns (iteration, consumed samples)."""
    latest = os.path.join(directory, LATEST)
    if not os.path.isfile(latest):
        raise CheckpointError(f"--load {directory}: no {LATEST} (nothing was saved there)")
    with open(latest) as f:
        iteration = int(f.read().strip())
    path = os.path.join(directory, f"iter_{iteration:07d}")
    with open(os.path.join(path, "meta.json"), encoding="utf-8") as f:
        meta = json.load(f)
    mine = {"tp": pg.tp.size, "dp": pg.dp.size, "distributed_optimizer": setup.optimizer.distributed}
    theirs = {k: meta[k] for k in mine}
    if mine != theirs:
        raise CheckpointError(f"--load {directory}: saved with {theirs}, this run has {mine}")
    tp, dp = pg.tp.rank, pg.dp.rank
    model_state = torch.load(os.path.join(path, f"model_tp{tp:02d}.pt"), map_location="cpu", weights_only=True)
    with torch.no_grad():
        setup.model.load_state_dict(model_state)
    opt_rank = dp if setup.optimizer.distributed else 0
    opt_state = torch.load(os.path.join(path, f"rank_tp{tp:02d}_dp{opt_rank:03d}.pt"), map_location="cpu",
                           weights_only=False)
    setup.optimizer.load_state_dict(opt_state["optimizer"])
    own = os.path.join(path, f"rank_tp{tp:02d}_dp{dp:03d}.pt")
    rng = torch.load(own, map_location="cpu", weights_only=False)["rng"]
    torch.set_rng_state(rng["torch"])
    if setup.rng_tracker is not None and rng["tracker"] is not None:
        setup.rng_tracker.set_states(rng["tracker"])
    return iteration, int(meta["consumed_samples"])
