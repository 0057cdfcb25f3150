"""Learning-rate schedule: linear warmup, then constant, linear, cosine or WSD decay to min_lr
(Megatron's OptimizerParamScheduler, without its inverse-square-root style).

Steps count from 1 and are iterations, or samples when a run is given in samples (the caller
passes runtime.train.config.lr_step). Step i of a run with W warmup steps uses lr * i / W while
i <= W (so the first step already moves the weights), then decays over the steps W .. D and
stays at min_lr after D (D defaults to the run's length).

WSD (warmup-stable-decay): after warmup the rate stays at lr until the last `wsd_decay_steps`
steps before D, and decays to min_lr over those in `wsd_style`: linear, cosine, exponential
(2 * 0.5**r - 1, Megatron's default) or minus_sqrt (1 - sqrt(r)), r the fraction of the decay
phase done.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

STYLES = ("constant", "linear", "cosine", "WSD")
WSD_STYLES = ("linear", "cosine", "exponential", "minus_sqrt")


@dataclass(frozen=True)
class LRSchedule:
    max_lr: float
    min_lr: float
    warmup_iters: float  # warmup steps (a --lr-warmup-fraction of the decay steps need not be whole)
    decay_iters: int  # decay steps
    style: str = "linear"  # constant | linear | cosine | WSD
    wsd_decay_steps: int = 0  # WSD: the final decay's length
    wsd_style: str = "exponential"

    def __post_init__(self):
        if self.style not in STYLES:
            raise ValueError(f"unknown lr decay style {self.style!r}")
        if self.warmup_iters < 0 or self.decay_iters < 1 or self.warmup_iters > self.decay_iters:
            raise ValueError(f"need 0 <= warmup ({self.warmup_iters}) <= decay iterations ({self.decay_iters})")
        if self.style == "WSD":
            if self.wsd_style not in WSD_STYLES:
                raise ValueError(f"unknown WSD decay style {self.wsd_style!r}")
            if not 0 < self.wsd_decay_steps <= self.decay_iters - self.warmup_iters:
                raise ValueError(f"need 0 < WSD decay steps ({self.wsd_decay_steps}) <= decay steps after warmup "
                                 f"({self.decay_iters - self.warmup_iters})")

    def __call__(self, iteration: int) -> float:
        if self.warmup_iters > 0 and iteration <= self.warmup_iters:
            return self.max_lr * iteration / self.warmup_iters
        if self.style == "constant":
            return self.max_lr
        if iteration >= self.decay_iters:
            return self.min_lr
        if self.style == "WSD":
            anneal_start = self.decay_iters - self.wsd_decay_steps
            if iteration <= anneal_start:
                coeff = 1.0
            else:
                ratio = (iteration - anneal_start) / self.wsd_decay_steps
                coeff = {"linear": lambda r: 1.0 - r, "cosine": lambda r: 0.5 * (math.cos(math.pi * r) + 1.0),
                         "exponential": lambda r: 2.0 * 0.5 ** r - 1.0,
                         "minus_sqrt": lambda r: 1.0 - math.sqrt(r)}[self.wsd_style](ratio)
            return self.min_lr + coeff * (self.max_lr - self.min_lr)
        span = self.decay_iters - self.warmup_iters
        ratio = (iteration - self.warmup_iters) / span
        if self.style == "linear":
            coeff = 1.0 - ratio
        else:
            coeff = 0.5 * (math.cos(math.pi * ratio) + 1.0)
        return self.min_lr + coeff * (self.max_lr - self.min_lr)
