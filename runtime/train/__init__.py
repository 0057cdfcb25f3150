"""Training: configuration, the loop (setup_model_and_optimizer, train, train_step, evaluate),
reporting, checkpoints and the launcher behind `specc train`."""

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
