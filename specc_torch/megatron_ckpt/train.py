"""`specc train --load MEGATRON_DIR --finetune`: a Megatron Core save directory (or one iter_N/
folder, torch_dist or legacy) as a run's starting weights, checked with the run's other rules
(specc_torch/train_checks.py check) and converted before the model loads; and `specc train --save DIR
--ckpt-format torch_dist`: each save also as Megatron's torch_dist iter_N/ beside specc's own
step_N/ in DIR (docs/training.md#checkpoints)."""

from __future__ import annotations

import os
import re
import shutil

import torch.distributed as dist

from runtime.checkpoint import INFO, LATEST, CheckpointError, complete_steps
from specc.errors import SpecError

from ..hf import HFError
from .convert import import_megatron, megatron_export_tensors
from .files import MegatronError, checkpoint_format, is_iteration_dir, is_megatron_dir, iteration_dir, write_dist

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
    """After specc saved step N in --save: its weights as Megatron's torch_dist iter_N/ and tracker
    in the same directory (weights only; under --keep-last the iter_M/ of the steps specc pruned
    go too). Every rank reads the full weights (the checkpoint's read is collective), rank 0
    writes; every rank gets the first error, or the folder written."""
    save = cfg.checkpoint.save
    error, written = None, None
    overrides = dict(cfg.overrides)
    if cfg.data.padded_vocab_size is not None and "vocab_size" not in overrides:
        overrides["vocab_size"] = cfg.data.padded_vocab_size
    try:
        got = megatron_export_tensors(save, cfg.spec, overrides, step=step)
        if rank == 0:
            written = write_dist(save, got["step"], got["tensors"], got["modules"])
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
    """--load of a Megatron Core save directory (or iter_N/): its weights load, converted through
    the spec's megatron.checkpoint names (specc_torch/megatron_ckpt); its optimizer state,
    iteration and data position do not, so it takes --finetune, as a weights-only start."""
    load = cfg.checkpoint.load
    try:
        fmt = checkpoint_format(iteration_dir(load)[0])
    except MegatronError as e:
        return [f"--load {load}: {e}"]
    if not cfg.checkpoint.finetune:
        return [f"--load {load}: a Megatron Core checkpoint ({fmt}) loads its weights only, not its optimizer state, "
                "iteration or data position: add --finetune (or convert it with specc megatron import)"]
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
            import_megatron(cfg.checkpoint.load, cfg.spec, converted, overrides)
        except (MegatronError, CheckpointError, HFError, SpecError) as e:
            error = f"--load {cfg.checkpoint.load}: {e}"
    if world > 1:
        errors = [None] * world
        dist.all_gather_object(errors, error)
        error = next((e for e in errors if e), None)
    if error:
        raise CheckpointError(error)
    return converted
