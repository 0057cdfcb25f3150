"""`specc train --load MEGATRON_DIR`: a Megatron Core save directory (or one iter_N/ folder) as
Megatron resumes it: torch_dist's weights, iteration, data position and optimizer state
(--no-load-optim: not the optimizer state; --finetune, and the legacy format: the weights only),
checked with the run's other rules (specc_torch/train_checks.py check) and converted before the
model loads; and `specc train --save DIR --ckpt-format torch_dist`: each save also as Megatron's
torch_dist iter_N/ (with the Adam state) beside specc's own step_N/ in DIR
(docs/training.md#checkpoints)."""

from __future__ import annotations

import dataclasses
import os
import re
import shutil

import torch.distributed as dist

from runtime.checkpoint import INFO, LATEST, CheckpointError, complete_steps
from specc.errors import SpecError

from ..hf import HFError
from .convert import import_megatron, megatron_export_tensors, optimizer_layout
from .files import (
    MegatronError,
    checkpoint_format,
    dist_tensors,
    is_iteration_dir,
    is_megatron_dir,
    iteration_dir,
    read_common,
    write_dist,
)

CKPT_FORMATS = ("torch_dist",)  # what --ckpt-format writes beside specc's own checkpoints


def is_foreign_megatron_dir(path: str) -> bool:
    """A Megatron save directory (or iter_N/) that is not also specc's: a --ckpt-format torch_dist
    run's --save holds both, and --load of it resumes specc's own checkpoint."""
    return is_megatron_dir(path) and not any(os.path.lexists(os.path.join(path, name)) for name in (LATEST, INFO))


def ckpt_format_rules(cfg) -> list:
    """--ckpt-format: torch_dist (Megatron's default) writes Megatron's checkpoint beside each of
    specc's, so it needs --save; Megatron's other formats are not written."""
    fmt = cfg.checkpoint.ckpt_format
    if fmt is None:
        return []
    if fmt not in CKPT_FORMATS:
        return [f"--ckpt-format {fmt}: only torch_dist (Megatron Core's default) is written, beside specc's own "
                "checkpoints; --load reads Megatron's torch_dist and legacy torch checkpoints whatever this says"]
    if cfg.checkpoint.save is None:
        return [f"--ckpt-format {fmt}: says what --save writes, and there is no --save DIR"]
    return []


def megatron_save(cfg, step: int, rank: int, world: int) -> str:
    """After specc saved step N in --save: its weights and Adam state as Megatron's torch_dist
    iter_N/ and tracker in the same directory (the state as Megatron's non-distributed optimizer
    saves it, param_groups from this run's --lr, --min-lr, --weight-decay, --adam-*; weights only
    where it cannot be written: convert.py _optimizer_refusal; under --keep-last the iter_M/ of
    the steps specc pruned go too). Every rank reads the full tensors (the checkpoint's read is
    collective), rank 0 writes; every rank gets the first error, or "FOLDER (what it holds)"."""
    save = cfg.checkpoint.save
    error, written = None, None
    overrides = dict(cfg.overrides)
    if cfg.data.padded_vocab_size is not None and "vocab_size" not in overrides:
        overrides["vocab_size"] = cfg.data.padded_vocab_size
    try:
        optimizer = dataclasses.asdict(cfg.optimizer) if cfg.optimizer.optimizer == "adam" else None
        got = megatron_export_tensors(save, cfg.spec, overrides, step=step, optimizer=optimizer)
        if rank == 0:
            written = write_dist(save, got["step"], got["tensors"], got["modules"], got["common"])
            note = got["optimizer"] if optimizer is not None else f"weights only: --optimizer {cfg.optimizer.optimizer}"
            written += f" ({note})"
            if cfg.checkpoint.keep_last is not None:
                kept = set(complete_steps(save))
                for name in os.listdir(save):
                    m = re.fullmatch(r"iter_(\d+)", name)
                    if m and int(m[1]) not in kept and is_iteration_dir(os.path.join(save, name)):
                        shutil.rmtree(os.path.join(save, name), ignore_errors=True)
    except (MegatronError, CheckpointError, HFError, SpecError, OSError) as e:
        error = f"--ckpt-format torch_dist: writing step {step} as Megatron's checkpoint failed: {e}"
    if world > 1:
        answers = [None] * world
        dist.all_gather_object(answers, (error, written))
        error = next((e for e, _w in answers if e), None)
        written = answers[0][1]
    if error:
        raise CheckpointError(error)
    return written


def megatron_load_rules(cfg) -> list:
    """--load of a Megatron Core save directory (or iter_N/), as Megatron loads it: its weights,
    iteration, data position and optimizer state (converted through the spec's
    megatron.checkpoint names, specc_torch/megatron_ckpt); --no-load-optim leaves the optimizer
    state, --finetune all but the weights. Without either it needs optimizer state that is read
    (torch_dist: the non-distributed optimizer's, or the distributed one's model-space layouts)
    and its args' consumed_train_samples."""
    load, ck = cfg.checkpoint.load, cfg.checkpoint
    try:
        path = iteration_dir(load)[0]
        fmt = checkpoint_format(path)
        if ck.finetune:
            return []
        if fmt == "torch":
            return [f"--load {load}: from Megatron's legacy torch format only the weights are read (not its optimizer "
                    "state, iteration or data position): add --finetune (or save it with --ckpt-format torch_dist)"]
        tensors = dist_tensors(path)
        objects = tensors.pop(None)
        common = read_common(path)
        has_optimizer = (any(k.startswith("optimizer.") for k in tensors) or common.get("optimizer") is not None
                         or any(o.startswith("optimizer.") for o in objects))
        consumed = getattr(common.get("args"), "consumed_train_samples", None)
        if has_optimizer and not ck.no_load_optim:
            optimizer_layout(path, common, objects)
    except MegatronError as e:
        return [f"--load {load}: {e}"]
    if not has_optimizer and not ck.no_load_optim:
        return [f"--load {load}: a Megatron Core checkpoint without optimizer state: add --no-load-optim (its "
                "weights, iteration and data position, a fresh optimizer) or --finetune (its weights only)"]
    if not isinstance(consumed, int):
        return [f"--load {load}: its args hold no consumed_train_samples (the data position to resume from): add "
                "--finetune to start from its weights at iteration 0"]
    return []


def megatron_import(cfg, local_rank: int, world: int) -> str:
    """--load of a Megatron checkpoint: one rank per node converts it into RUN_DIR/megatron-import
    (a specc checkpoint of full tensors, which loads at this run's layout); every rank gets the
    first error, or the converted directory."""
    converted = os.path.join(cfg.logging.run_dir, "megatron-import")
    error = None
    if local_rank == 0:
        overrides = dict(cfg.overrides)
        if cfg.data.padded_vocab_size is not None and "vocab_size" not in overrides:
            overrides["vocab_size"] = cfg.data.padded_vocab_size
        try:
            shutil.rmtree(converted, ignore_errors=True)  # derived: a previous run's conversion
            ck = cfg.checkpoint
            import_megatron(ck.load, cfg.spec, converted, overrides, optimizer_state=not ck.no_load_optim,
                            resume=not ck.finetune)
        except (MegatronError, CheckpointError, HFError, SpecError) as e:
            error = f"--load {cfg.checkpoint.load}: {e}"
    if world > 1:
        errors = [None] * world
        dist.all_gather_object(errors, error)
        error = next((e for e in errors if e), None)
    if error:
        raise CheckpointError(error)
    return converted
