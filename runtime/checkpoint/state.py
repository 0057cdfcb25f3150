"""What a model and a training state hold, as a checkpoint stores them:
- parameters under their `model.named_parameters()` names at FULL shape ("model/NAME"): each
  rank writes the blocks of its shard (one per fused segment); replicated blocks are written once;
- optimizer state: per-parameter tensors given as `ParamShard`s are stored at the parameter's full
  shape too ("optimizer/PATH"), whatever TP/DP layout sharded them; other tensors are rank-local;
  other values (the step count) are replicated;
- the learning-rate schedule and the data position (replicated plain values), each rank's RNG
  states (torch's and the RNG tracker's), and the effective configuration (JSON).
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from typing import Any

import torch

from ..init import init_name, is_tied_copy
from ..parallel_state import ProcessGroups
from .boxes import Boxes, flat_boxes, param_boxes

_PLAIN = (str, int, float, bool, type(None))


@dataclass(frozen=True)
class ParamShard:
    """A per-parameter tensor (e.g. Adam's exp_avg of parameter `param`) as this rank holds it.

    `tensor` is either shaped like this rank's TP shard of the parameter, or 1-D: elements
    [start, start + numel) of the row-major flattening of that shard (a data-parallel shard of
    a flat buffer, as the distributed optimizer holds it). The checkpoint stores the tensor at the
    parameter's FULL shape; loading fills `tensor` in place for any TP/DP layout."""

    param: str
    tensor: torch.Tensor
    start: int = 0


@dataclass(frozen=True)
class RankLocal:
    """A value that differs between ranks and is restored only on the same layout."""

    value: Any


def flat_param_shards(model: torch.nn.Module, param_range: dict, lo: int, hi: int, flat: torch.Tensor) -> dict:
    """ParamShards of a flat buffer range, as a distributed optimizer holds its state: `flat` holds
    elements [lo, hi) of a buffer in which parameter p occupies param_range[p] = (start, end),
    flattened row-major (runtime.ddp's layout). Returns {name: ParamShard} for the parameters
    that overlap [lo, hi)."""
    if flat.dim() != 1 or flat.numel() != hi - lo:
        raise ValueError(f"flat must be 1-D with hi - lo = {hi - lo} elements, got shape {tuple(flat.shape)}")
    out = {}
    for name, p in model.named_parameters():
        if p not in param_range:
            continue
        start, end = param_range[p]
        a, b = max(start, lo), min(end, hi)
        if a < b:
            name = init_name(name, p)  # a weight tied across pipeline stages: under its owner's name
            out[name] = ParamShard(name, flat[a - lo:b - lo], start=a - start)
    return out


def _layout(pg: ProcessGroups) -> dict:
    layout = {"tp": pg.tp.size, "cp": pg.cp.size, "dp": pg.dp.size, "pp": pg.pp.size, "world_size": pg.world_size}
    if pg.ep.size > 1:  # experts split over the DP ranks: another layout of the same world
        layout["ep"] = pg.ep.size
    return layout


def _describe(layout: dict) -> str:
    return " ".join(f"{k}={layout[k]}" for k in ("tp", "cp", "dp", "pp", "ep") if k in layout)


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def _spec_identity(model, spec_name, spec_sha256) -> dict:
    """The spec a compiled model came from: explicit, or the generated module's SPEC_* globals."""
    namespace = {}
    init = getattr(type(model), "__init__", None)
    if init is not None and hasattr(init, "__globals__"):
        namespace = init.__globals__
    return {"name": spec_name if spec_name is not None else namespace.get("SPEC_NAME"),
            "sha256": spec_sha256 if spec_sha256 is not None else namespace.get("SPEC_SHA256")}


def _param_entries(model, saving: bool = False) -> tuple[dict, dict, dict]:
    """(entries "model/NAME" -> Boxes of this rank's shard, {NAME: shape/dtype}, {NAME: param}).

    NAME is the PP = 1 model's: a pipeline stage keeps global layer indices, and the last stage's
    copy of a weight tied to the first stage's is stored once, under the owner's name (the first
    stage writes it; when `saving`, the copy is left out), and loaded into both."""
    entries, described, params = {}, {}, {}
    for name, p in model.named_parameters():
        name = init_name(name, p)
        params[name] = p
        if saving and is_tied_copy(p):
            continue
        meta = getattr(p, "_specc_init", None)
        shape = tuple(meta.full_shape) if meta is not None else tuple(p.shape)
        entries[f"model/{name}"] = Boxes(shape, p.dtype, param_boxes(p.detach(), meta))
        described[name] = {"shape": list(shape), "dtype": _dtype_name(p.dtype)}
    return entries, described, params


def _everyones(world, described: dict) -> dict:
    """The union of every rank's parameters (pipeline stages hold different ones), by name."""
    out = {}
    for theirs in world.gather(described):
        for name, d in theirs.items():
            out.setdefault(name, d)
    return out  # rank 0's order first (the model's), then the names only other stages hold


def _walk(obj, path=()):
    """(path, leaf) for every leaf of nested dicts / lists / tuples."""
    if isinstance(obj, dict):
        for key, value in obj.items():
            if not isinstance(key, (str, int)):
                raise ValueError(f"state key {key!r} at {_path_text(path)} must be a string or an integer")
            yield from _walk(value, path + (key,))
    elif isinstance(obj, (list, tuple)):
        for i, value in enumerate(obj):
            yield from _walk(value, path + (i,))
    else:
        yield path, obj


def _rebuild(obj, fn, path=()):
    if isinstance(obj, dict):
        return {k: _rebuild(v, fn, path + (k,)) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_rebuild(v, fn, path + (i,)) for i, v in enumerate(obj))
    return fn(path, obj)


def _path_text(path) -> str:
    return "/".join(str(k) for k in path) or "(the top level)"


def _check_plain(obj, what: str) -> None:
    """Checkpoint values are tensors and plain Python values (loaded with weights_only=True)."""
    for path, leaf in _walk(obj):
        if not isinstance(leaf, (torch.Tensor,) + _PLAIN):
            raise ValueError(f"{what} at {_path_text(path)} is of type {type(leaf).__name__}; checkpoints hold "
                             f"tensors, numbers, strings, booleans and None, in dicts, lists and tuples")


def _shard_boxes(shard: ParamShard, params: dict) -> Boxes:
    if shard.param not in params:
        raise ValueError(f"ParamShard names parameter {shard.param!r}, which the model does not have")
    p = params[shard.param]
    meta = getattr(p, "_specc_init", None)
    shape = tuple(meta.full_shape) if meta is not None else tuple(p.shape)
    t = shard.tensor.detach()
    if tuple(t.shape) == tuple(p.shape) and shard.start == 0:
        boxes = param_boxes(t, meta)
    else:
        boxes = flat_boxes(t, shard.start, meta, tuple(p.shape))
    return Boxes(shape, t.dtype, boxes)


def _split_state(state, params: dict, saving: bool = False) -> tuple[dict, dict, dict, dict]:
    """Optimizer state -> (entries "optimizer/PATH" -> Boxes, {PATH: described}, replicated
    {path: value}, rank-local {path: value})."""
    entries, described, replicated, local = {}, {}, {}, {}
    for path, leaf in _walk(state):
        if isinstance(leaf, ParamShard) and saving and leaf.param in params and is_tied_copy(params[leaf.param]):
            continue  # the first stage saves the tied weight's state (the same numbers)
        if isinstance(leaf, ParamShard):
            key = _path_text(path)
            boxes = _shard_boxes(leaf, params)
            entries[f"optimizer/{key}"] = boxes
            described[key] = {"param": leaf.param, "shape": list(boxes.shape), "dtype": _dtype_name(boxes.dtype)}
        elif isinstance(leaf, RankLocal):
            _check_plain(leaf.value, f"optimizer state {_path_text(path)}")
            local[path] = leaf.value
        elif isinstance(leaf, torch.Tensor):
            local[path] = leaf.detach()
        elif isinstance(leaf, _PLAIN):
            replicated[path] = leaf
        else:
            raise ValueError(f"optimizer state at {_path_text(path)} is of type {type(leaf).__name__}; use tensors, "
                             f"ParamShard, RankLocal or plain values")
    return entries, described, replicated, local


def _rng_state(rng_tracker) -> dict:
    state = {"torch": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()
    if rng_tracker is not None:
        state["tracker"] = rng_tracker.get_states()
    return state


def _set_rng_state(state: dict, rng_tracker) -> None:
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
    if rng_tracker is not None and "tracker" in state:
        rng_tracker.set_states(state["tracker"])


def _same(a, b) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.dtype == b.dtype
                and a.shape == b.shape and torch.equal(a, b))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return type(a) is type(b) and a == b


def _jsonable(config):
    if config is None:
        return None
    if dataclasses.is_dataclass(config) and not isinstance(config, type):
        config = dataclasses.asdict(config)
    return json.loads(json.dumps(config, default=str))
