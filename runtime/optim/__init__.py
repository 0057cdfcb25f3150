"""Optimizers over DistributedDataParallel's flat buffers, and the learning-rate schedule."""

from .adam import Adam
from .lr import LRSchedule

__all__ = ["Adam", "LRSchedule"]
