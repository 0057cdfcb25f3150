"""Sharded checkpoints through torch.distributed.checkpoint: parameters (and per-parameter
optimizer state) stored under layout-independent names at full shape, so a checkpoint saved at
one TP x DP layout loads at any other; atomic saves with a `latest` pointer; every file checked
before anything is loaded; one run per save directory (lock.py). See core.py (save and load),
on_disk.py (the save directory on disk), state.py (what is stored), world.py, and docs/checkpoints.md."""

from .adam import adam_state, restore_adam
from .core import (
    check_params,
    check_spec,
    load_checkpoint,
    read_optimizer_tensors,
    read_tensors,
    save_checkpoint,
    save_tensors,
)
from .errors import CheckpointError
from .lock import LOCK, RunLock, SaveDirBusy, check_free, lock_save_dir, run_identity, same_run
from .on_disk import INFO, LATEST, complete_steps, latest_step, read_info, resolve, step_dirname
from .state import ParamShard, RankLocal, flat_param_shards

__all__ = [
    "CheckpointError",
    "INFO",
    "LOCK",
    "RunLock",
    "SaveDirBusy",
    "check_free",
    "lock_save_dir",
    "run_identity",
    "same_run",
    "adam_state",
    "restore_adam",
    "LATEST",
    "ParamShard",
    "RankLocal",
    "check_params",
    "check_spec",
    "complete_steps",
    "flat_param_shards",
    "latest_step",
    "load_checkpoint",
    "read_info",
    "read_optimizer_tensors",
    "read_tensors",
    "resolve",
    "save_checkpoint",
    "save_tensors",
    "step_dirname",
]
