"""The checkpoint view of runtime.optim.Adam (replicated or distributed): its flat, possibly
DP-sharded buffers as per-parameter ParamShards, so the state is stored at each parameter's full
shape and loads at any TP/DP layout.

    state = adam_state(optimizer, model)                  # save: optimizer_state=state
    out = load_checkpoint(dir, model, pg, optimizer_state=adam_state(optimizer, model))
    restore_adam(optimizer, out["optimizer_state"])       # the step count; tensors are already in place
"""

from __future__ import annotations

from .state import flat_param_shards


def adam_state(optimizer, model) -> dict:
    """{"step", "exp_avg", "exp_avg_sq"[, "master"]}: the moment (and fp32 master weight) shards
    this rank holds, by parameter name, as views of the optimizer's own buffers. Any of
    runtime.optim's optimizers: its STATE names the tensors (SGD: "momentum_buffer")."""
    param_range = optimizer.ddp.param_range
    state = {"step": int(optimizer.step_count), **{name: {} for name in optimizer.STATE}}
    if optimizer.separate_master:
        state["master"] = {}
    for r in optimizer.ranges:
        for name in optimizer.STATE:
            state[name].update(flat_param_shards(model, param_range, r.lo, r.hi, getattr(r, name)))
        if optimizer.separate_master:
            state["master"].update(flat_param_shards(model, param_range, r.lo, r.hi, r.master))
    return state


def restore_adam(optimizer, loaded: dict) -> None:
    """After load_checkpoint(optimizer_state=adam_state(...)): the buffers were filled in place;
    set the step count (Adam's bias correction)."""
    optimizer.step_count = int(loaded["step"])
