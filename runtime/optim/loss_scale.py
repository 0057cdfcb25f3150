"""fp16 loss scaling, Megatron's grad scalers (megatron/core/optimizer/grad_scaler.py).

The loss is multiplied by `scale` before backward so that small fp16 gradients do not flush to
zero; the optimizer divides the fp32 gradients by it, checks them for inf/nan on every rank
(FlatOptimizer.found_inf) and calls update(found_inf).

DynamicGradScaler: an overflow resets the growth count and uses up one of `hysteresis`
tolerated overflows; when they are used up the scale is multiplied by `backoff_factor` (never
below `min_scale`). After `growth_interval` steps in a row without one, the scale is multiplied by
`growth_factor` and the hysteresis is restored. ConstantGradScaler (--loss-scale S) never moves.

torch.amp.GradScaler is not used: it unscales and checks the `.grad` of a torch.optim
optimizer's parameters on one rank, while here the gradients live in DistributedDataParallel's
flat fp32 buffer (each rank holding only its shard under the distributed optimizer), and the
found-inf flag must be reduced over every parallel axis so that all ranks skip together.
"""

from __future__ import annotations


class ConstantGradScaler:
    def __init__(self, scale: float):
        if not scale > 0:
            raise ValueError(f"the loss scale must be positive, got {scale}")
        self.scale = float(scale)

    def update(self, found_inf: bool) -> None:
        pass

    def state_dict(self) -> dict:
        return {"scale": self.scale}

    def load_state_dict(self, state: dict) -> None:
        self.scale = float(state["scale"])


class DynamicGradScaler:
    def __init__(self, initial_scale: float = 2.0 ** 32, min_scale: float = 1.0, growth_factor: float = 2.0,
                 backoff_factor: float = 0.5, growth_interval: int = 1000, hysteresis: int = 2):
        if not (0 < min_scale <= initial_scale):
            raise ValueError(f"need 0 < min_scale ({min_scale}) <= initial_scale ({initial_scale})")
        if not (growth_factor > 1 and 0 < backoff_factor < 1 and growth_interval >= 1 and hysteresis >= 1):
            raise ValueError("need growth_factor > 1, 0 < backoff_factor < 1, growth_interval >= 1, hysteresis >= 1")
        self.scale = float(initial_scale)
        self.min_scale, self.growth_factor, self.backoff_factor = float(min_scale), growth_factor, backoff_factor
        self.growth_interval, self.hysteresis = growth_interval, hysteresis
        self.growth_tracker = 0
        self.hysteresis_tracker = hysteresis

    def update(self, found_inf: bool) -> None:
        if found_inf:
            self.growth_tracker = 0
            self.hysteresis_tracker -= 1
            if self.hysteresis_tracker <= 0:
                self.scale = max(self.scale * self.backoff_factor, self.min_scale)
        else:
            self.growth_tracker += 1
            if self.growth_tracker == self.growth_interval:
                self.growth_tracker = 0
                self.hysteresis_tracker = self.hysteresis
                self.scale *= self.growth_factor

    def state_dict(self) -> dict:
        return {"scale": self.scale, "growth_tracker": self.growth_tracker,
                "hysteresis_tracker": self.hysteresis_tracker}

    def load_state_dict(self, state: dict) -> None:
        self.scale = float(state["scale"])
        self.growth_tracker = int(state["growth_tracker"])
        self.hysteresis_tracker = int(state["hysteresis_tracker"])
