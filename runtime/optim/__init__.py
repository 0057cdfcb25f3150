"""Optimizers over DistributedDataParallel's flat buffers, fp16 loss scaling, and the
learning-rate schedule."""

from .adam import SGD, Adam, FlatOptimizer
from .loss_scale import ConstantGradScaler, DynamicGradScaler
from .lr import LRSchedule

__all__ = ["Adam", "SGD", "FlatOptimizer", "ConstantGradScaler", "DynamicGradScaler", "LRSchedule"]
