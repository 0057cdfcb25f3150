"""Learning-rate schedule: linear warmup, then constant, linear or cosine decay to min_lr.

Iterations count from 1: iteration i of a run with W warmup iterations uses lr * i / W while
i <= W (so the first step already moves the weights), then decays over the iterations
W+1 .. D and stays at min_lr after D (D defaults to --train-iters).
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class LRSchedule:
    max_lr: float
    min_lr: float
    warmup_iters: int
    decay_iters: int
    style: str = "linear"  # constant | linear | cosine

    def __post_init__(self):
        if self.style not in ("constant", "linear", "cosine"):
            raise ValueError(f"unknown lr decay style {self.style!r}")
        if self.warmup_iters < 0 or self.decay_iters < 1 or self.warmup_iters > self.decay_iters:
            raise ValueError(f"need 0 <= warmup ({self.warmup_iters}) <= decay iterations ({self.decay_iters})")

    def __call__(self, iteration: int) -> float:
        if self.warmup_iters > 0 and iteration <= self.warmup_iters:
            return self.max_lr * iteration / self.warmup_iters
        if self.style == "constant":
            return self.max_lr
        if iteration >= self.decay_iters:
            return self.min_lr
        span = self.decay_iters - self.warmup_iters
        ratio = (iteration - self.warmup_iters) / span
        if self.style == "linear":
            coeff = 1.0 - ratio
        else:
            coeff = 0.5 * (math.cos(math.pi * ratio) + 1.0)
        return self.min_lr + coeff * (self.max_lr - self.min_lr)
