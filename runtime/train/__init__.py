"""Training: configuration, the loop (setup_model_and_optimizer, train, train_step, evaluate) and
reporting. The launcher behind `specc train` and `torchrun -m specc_cli.rank`, which compiles
the spec and hands it to the loop, is specc_torch.train."""

from .config import TrainConfig, resolve
from .training import (
    FORWARD_STEPS,
    Setup,
    StepResult,
    TrainState,
    evaluate,
    lm_forward_step,
    setup_model_and_optimizer,
    train,
    train_step,
)

__all__ = [
    "TrainConfig", "resolve", "FORWARD_STEPS", "Setup", "StepResult", "TrainState", "evaluate",
    "lm_forward_step", "setup_model_and_optimizer", "train", "train_step",
]
