"""Sharded checkpoints through torch.distributed.checkpoint: parameters (and per-parameter
optimizer state) stored under layout-independent names at full shape, so a checkpoint saved at
one TP x DP layout loads at any other; atomic saves with a `latest` pointer; every file checked
before anything is loaded; one run per save directory (lock.py). See core.py and
docs/checkpoints.md."""

from .adam import adam_state, restore_adam
from .core import (
    INFO,
    LATEST,
    CheckpointError,
    ParamShard,
    RankLocal,
    check_params,
    check_spec,
    complete_steps,
    flat_param_shards,
    latest_step,
    load_checkpoint,
    read_info,
    read_tensors,
    resolve,
    save_checkpoint,
    save_tensors,
    step_dirname,
)
from .lock import LOCK, RunLock, SaveDirBusy, check_free, lock_save_dir, run_identity, same_run

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
    "read_tensors",
    "resolve",
    "save_checkpoint",
    "save_tensors",
    "step_dirname",
]
