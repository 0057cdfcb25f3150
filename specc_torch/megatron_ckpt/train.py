"""`specc train --load MEGATRON_DIR --finetune`: a Megatron Core save directory (or one iter_N/
folder, torch_dist or legacy) as a run's starting weights, checked with the run's other rules
(specc_torch/train.py check) and converted before the model loads (docs/training.md)."""

from __future__ import annotations

import os
import shutil

import torch.distributed as dist

from runtime.checkpoint import CheckpointError
from specc.errors import SpecError

from ..hf import HFError
from .convert import import_megatron
from .files import MegatronError, checkpoint_format, iteration_dir


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
