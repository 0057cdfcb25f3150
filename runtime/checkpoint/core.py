"""Sharded, resharding, atomic checkpoints.

On disk (see docs/checkpoints.md):

    DIR/latest                   the step of the newest complete checkpoint ("1200\\n")
    DIR/step_0001200/            one checkpoint: DCP files, then checkpoint.json, written last
        .metadata                DCP: every entry, its full size and the blocks that were saved
        __0_0.distcp ...         DCP: one file per rank that wrote something
        checkpoint.json          step, spec, layout, parameter names and full shapes, config,
                                 and every file's size and crc32

What is stored:
- parameters under their `model.named_parameters()` names at FULL shape ("model/NAME"): each
  rank writes the blocks of its shard (one per fused segment); replicated blocks are written once;
- optimizer state: per-parameter tensors given as `ParamShard`s are stored at the parameter's full
  shape too ("optimizer/PATH"), whatever TP/DP layout sharded them; other tensors are rank-local;
  other values (the step count) are replicated;
- the learning-rate schedule and the data position (replicated plain values), each rank's RNG
  states (torch's and the RNG tracker's), and the effective configuration (JSON).

A save writes into DIR/step_N.tmp-XXXX, syncs every file, writes checkpoint.json, renames the
directory to step_N, and only then replaces DIR/latest (write + fsync + os.replace). A save killed
at any point leaves the previous checkpoint and `latest` as they were.
"""

from __future__ import annotations

import dataclasses
import errno
import json
import os
import re
import secrets
import shutil
import stat
import zlib
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from ..files import check_replaceable, not_a_file, replace
from ..init import init_name, is_tied_copy
from ..parallel_state import ProcessGroups
from . import dcp
from .boxes import Boxes, flat_boxes, param_boxes
from .errors import CheckpointError
from .lock import SaveDirBusy, lock_for_save

LATEST = "latest"
INFO = "checkpoint.json"
DCP_METADATA = ".metadata"  # DCP's index: every entry and the file, offset and length of each saved block
FORMAT = "specc-checkpoint"
VERSION = 1
_STEP_DIR = re.compile(r"step_(\d+)$")
_SAVED_DIR = re.compile(r"step_(\d+)(\.old-[0-9a-f]+)?$")  # a checkpoint's directory (one saved over: .old-)
_TEMP_DIR = re.compile(r"step_(\d+)\.(tmp|old|del)-[0-9a-f]+$")
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


def step_dirname(step: int) -> str:
    return f"step_{step:07d}"


# -- the world, with or without torch.distributed ----------------------------------------------------

class _World:
    def __init__(self):
        self.on = dcp.distributed()
        self.rank = dist.get_rank() if self.on else 0
        self.size = dist.get_world_size() if self.on else 1

    def gather(self, obj) -> list:
        if not self.on:
            return [obj]
        out = [None] * self.size
        dist.all_gather_object(out, obj)
        return out

    def broadcast(self, obj):
        if not self.on:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def agree(self, error: str | None, kind=None) -> None:
        """Raise the first rank's error on every rank (no rank walks into a collective alone)."""
        errors = [e for e in self.gather(error) if e]
        if errors:
            raise (kind or CheckpointError)(errors[0])


# -- small file-system helpers -------------------------------------------------------------------

def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_durably(path: str, text: str) -> None:
    with open(path, "w", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


def _crc32(path: str) -> str:
    crc = 0
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            crc = zlib.crc32(chunk, crc)
    return f"{crc:08x}"


def _file_owner(name: str, world: int) -> int:
    """The rank that wrote (and so checks) a DCP file: __R_N.distcp -> R; .metadata -> 0."""
    m = re.match(r"__(\d+)_", name)
    return int(m.group(1)) % world if m else 0


# -- what a model and a state hold ---------------------------------------------------------------

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


# -- save ----------------------------------------------------------------------------------------

def save_checkpoint(directory: str, step: int, model: torch.nn.Module, pg: ProcessGroups | None = None, *,
                    optimizer_state=None, scheduler_state=None, rng_tracker=None, data_state=None, config=None,
                    spec_sha256: str | None = None, spec_name: str | None = None,
                    keep_last: int | None = None) -> str:
    """Save a checkpoint of `step` into DIRECTORY/step_N atomically; every rank calls it.

    model: the compiled module (not a DDP wrapper): its parameters are stored at full shape.
    optimizer_state: nested dicts/lists whose leaves are ParamShard (resharded on load), tensors or
        RankLocal (restored on the same layout only) and plain values (replicated: the same on
        every rank, e.g. the step count).
    scheduler_state, data_state: plain values, the same on every rank (e.g. {"consumed_samples": n}).
    rng_tracker: a runtime.RNGTracker; torch's RNG state is saved per rank as well.
    config: the effective configuration (a dict or dataclass; stored as JSON).
    spec_sha256, spec_name: default to the generated module's SPEC_SHA256 and SPEC_NAME.
    keep_last: keep only the newest K checkpoints in DIRECTORY.
    Returns the checkpoint's path.
    """
    pg = pg if pg is not None else ProcessGroups.single()
    world = _World()
    if not isinstance(step, int) or step < 0:
        raise ValueError(f"step must be a non-negative integer, got {step!r}")
    if keep_last is not None and (not isinstance(keep_last, int) or keep_last < 1):
        raise ValueError(f"keep_last must be a positive integer, got {keep_last!r}")

    entries, described, params = _param_entries(model, saving=True)
    described = _everyones(world, described)
    error, opt = None, None
    try:
        opt = _split_state(optimizer_state, params, saving=True) if optimizer_state is not None else None
        _check_plain(scheduler_state, "scheduler_state")
        _check_plain(data_state, "data_state")
    except ValueError as e:
        error = str(e)
    world.agree(error, ValueError)

    replicated = {"optimizer": opt[2] if opt else None, "scheduler": scheduler_state, "data": data_state}
    gathered = world.gather((replicated, opt[1] if opt else None))
    for rank, (theirs, _) in enumerate(gathered):
        for section in replicated:
            if not _same(theirs[section], gathered[0][0][section]):
                what = {"optimizer": "optimizer_state's plain values", "scheduler": "scheduler_state",
                        "data": "data_state"}[section]
                raise ValueError(f"{what} differ between rank 0 and rank {rank}; replicated values must be the same "
                                 f"on every rank (wrap a per-rank value in RankLocal)")
    opt_described = {}
    for _, theirs in gathered:
        opt_described.update(theirs or {})

    if opt:
        entries.update(opt[0])
    entries["replicated"] = {**replicated, "step": step}  # the step in the data, checked against checkpoint.json
    entries[f"rank/{world.rank:05d}"] = {"optimizer": opt[3] if opt else None, "rng": _rng_state(rng_tracker)}
    info = {
        "format": FORMAT, "version": VERSION, "step": step,
        "spec": _spec_identity(model, spec_name, spec_sha256),
        "layout": _layout(pg),
        "params": described,
        "optimizer": {"sharded": opt_described} if optimizer_state is not None else None,
        "scheduler": scheduler_state is not None, "data": data_state is not None, "rng": True,
        "config": _jsonable(config),
        "torch": torch.__version__,
    }
    return _write(directory, step, entries, info, world, keep_last)


def save_tensors(directory: str, step: int, tensors: dict, *, spec_sha256: str | None = None,
                 spec_name: str | None = None, config=None, keep_last: int | None = None) -> str:
    """A checkpoint of full tensors by parameter name, from one process (e.g. an imported model):
    loadable by load_checkpoint at any TP/DP layout."""
    world = _World()
    entries, described = {}, {}
    for name, t in tensors.items():
        t = t.detach().contiguous()
        entries[f"model/{name}"] = Boxes(tuple(t.shape), t.dtype, [((0,) * t.dim(), t)])
        described[name] = {"shape": list(t.shape), "dtype": _dtype_name(t.dtype)}
    entries["replicated"] = {"optimizer": None, "scheduler": None, "data": None, "step": step}
    info = {
        "format": FORMAT, "version": VERSION, "step": step,
        "spec": {"name": spec_name, "sha256": spec_sha256},
        "layout": _layout(ProcessGroups.single()),
        "params": described, "optimizer": None, "scheduler": False, "data": False, "rng": False,
        "config": _jsonable(config), "torch": torch.__version__,
    }
    return _write(directory, step, entries, info, world, keep_last)


def _write(directory: str, step: int, entries: dict, info: dict, world: _World, keep_last) -> str:
    name = step_dirname(step)
    lock, suffix, error, kind = None, None, None, CheckpointError
    if world.rank == 0:
        try:
            os.makedirs(directory, exist_ok=True)
            lock = lock_for_save(directory)  # None: this process holds it for its whole run
            _clean_stale(directory)
            suffix = secrets.token_hex(4)
            os.makedirs(os.path.join(directory, f"{name}.tmp-{suffix}"))
        except CheckpointError as e:  # SaveDirBusy: another process's run or save
            error, kind = str(e), type(e)
        except OSError as e:
            error = _save_failed(directory, step, e)
    try:
        suffix, error, busy = world.broadcast((suffix, error, kind is SaveDirBusy))
        if error:
            raise (SaveDirBusy if busy else CheckpointError)(error)
        tmp = os.path.join(directory, f"{name}.tmp-{suffix}")
        mine, error = {}, None
        try:
            dcp.save(tmp, entries)
            for fname in sorted(os.listdir(tmp)):
                if _file_owner(fname, world.size) == world.rank:
                    fpath = os.path.join(tmp, fname)
                    mine[fname] = {"bytes": os.path.getsize(fpath), "crc32": _crc32(fpath)}
        except Exception as e:  # noqa: BLE001 - a failed write (a full disk) is one line, on every rank
            error = _save_failed(directory, step, e)
        files, errors = {}, []
        for theirs, their_error in world.gather((mine, error)):
            files.update(theirs)
            errors += [their_error] if their_error else []
        if errors:
            if world.rank == 0:  # nothing half-written is left behind; `latest` and its step are untouched
                shutil.rmtree(tmp, ignore_errors=True)
            raise CheckpointError(errors[0])

        status = None
        if world.rank == 0:
            try:
                info["files"] = dict(sorted(files.items()))
                _write_durably(os.path.join(tmp, INFO), json.dumps(info, indent=1) + "\n")
                _fsync_dir(tmp)
                _publish(directory, name, tmp, step, suffix)
                if keep_last is not None:
                    _prune(directory, keep_last)
            except OSError as e:
                status = _save_failed(directory, step, e)
                shutil.rmtree(tmp, ignore_errors=True)  # (gone already once it was renamed into place)
                latest_tmp = os.path.join(directory, f"{LATEST}.tmp-{suffix}")
                if os.path.lexists(latest_tmp):
                    os.remove(latest_tmp)
        status = world.broadcast(status)
        if status:
            raise CheckpointError(status)
    finally:
        if lock is not None:
            lock.release()
    return os.path.join(directory, name)


def _disk_full(e: BaseException) -> OSError | None:
    """The OSError ENOSPC (or EDQUOT) behind a failed write, wherever it sits: raised as is, the
    cause or context of another error (torch.save's "unexpected pos" RuntimeError has it as its
    context), or one rank's failure inside a DCPError."""
    seen, stack = set(), [e]
    while stack:
        x = stack.pop()
        if x is None or id(x) in seen:
            continue
        seen.add(id(x))
        if isinstance(x, OSError) and x.errno in (errno.ENOSPC, errno.EDQUOT):
            return x
        stack += [x.__cause__, x.__context__, *getattr(x, "errors", ())]
    return None


def _save_failed(directory: str, step: int, e: BaseException) -> str:
    """One line for a save that failed: a full disk says so, with what is still there."""
    full = _disk_full(e)
    if full is None:
        text = str(e).strip().splitlines() if isinstance(e, OSError) else [_first_line(e)]
        return f"{directory}: saving step {step} failed: {text[0] if text else type(e).__name__}"
    try:
        before = latest_step(directory)
    except CheckpointError:
        before = None
    kept = (f"the checkpoint of step {before} is intact and '{LATEST}' still names it" if before is not None
            else "nothing was saved here before")
    what = "the disk quota is exceeded" if full.errno == errno.EDQUOT else "the disk is full"
    return (f"{directory}: saving step {step} failed: {what} ({full.strerror or os.strerror(full.errno)}); {kept}, "
            f"and no part of step {step} is left; free some space (or keep fewer checkpoints) and resume")


def _publish(directory: str, name: str, tmp: str, step: int, suffix: str) -> None:
    final = os.path.join(directory, name)
    check_replaceable(os.path.join(directory, LATEST))  # `latest` a regular file or nothing: before anything moves
    old = None
    if os.path.exists(final):  # the same step saved again: keep the old one until the new one is in place
        old = f"{final}.old-{suffix}"
        os.rename(final, old)
    os.rename(tmp, final)
    _fsync_dir(directory)
    latest_tmp = os.path.join(directory, f"{LATEST}.tmp-{suffix}")
    _write_durably(latest_tmp, f"{step}\n")
    replace(latest_tmp, os.path.join(directory, LATEST))  # only over a regular file (checked just before)
    _fsync_dir(directory)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def complete_steps(directory: str) -> list:
    """Steps of the complete checkpoints in DIRECTORY, oldest first."""
    if not os.path.isdir(directory):
        return []
    steps = []
    for entry in os.listdir(directory):
        m = _STEP_DIR.match(entry)
        if m and os.path.isfile(os.path.join(directory, entry, INFO)):
            steps.append(int(m.group(1)))
    return sorted(steps)


def _prune(directory: str, keep_last: int) -> None:
    keep = set(complete_steps(directory)[-keep_last:])
    current = latest_step(directory)
    if current is not None:
        keep.add(current)
    for step in complete_steps(directory):
        if step not in keep:
            path = os.path.join(directory, step_dirname(step))
            doomed = f"{path}.del-{secrets.token_hex(4)}"
            os.rename(path, doomed)  # gone from view at once; the files go next
            shutil.rmtree(doomed, ignore_errors=True)


def _clean_stale(directory: str) -> None:
    """Remove what killed saves and prunes left behind (never a complete step_N)."""
    for entry in os.listdir(directory):
        m = _TEMP_DIR.match(entry)
        if m and (m.group(2) != "old" or os.path.isfile(os.path.join(directory, step_dirname(int(m.group(1))), INFO))):
            shutil.rmtree(os.path.join(directory, entry), ignore_errors=True)
        elif entry.startswith(f"{LATEST}.tmp-"):
            os.remove(os.path.join(directory, entry))


# -- load ----------------------------------------------------------------------------------------

def _not_readable_file(path: str) -> str | None:
    """What `path` leads to when it is not a regular file (a link to one is read); None when it is
    one or nothing is there."""
    try:
        mode = os.stat(path).st_mode
    except OSError:
        return None  # nothing there (or unreadable): the read says which
    if stat.S_ISREG(mode) or stat.S_ISDIR(mode):  # a directory: the read says so
        return None
    return not_a_file(os.path.realpath(path))


def latest_step(directory: str) -> int | None:
    """The step `DIRECTORY/latest` names, or None when nothing was saved there."""
    path = os.path.join(directory, LATEST)
    what = _not_readable_file(path)
    if what is not None:  # a FIFO would block the read, a device could be read forever
        raise CheckpointError(f"{path}: is {what}, not the file naming the latest step")
    try:
        with open(path, "rb") as f:
            raw = f.read(4096)
    except FileNotFoundError:
        return None
    except IsADirectoryError:
        raise CheckpointError(f"{path}: is a directory, not the file naming the latest step") from None
    except OSError as e:
        raise CheckpointError(f"{path}: cannot read it ({e.strerror or e})") from None
    text = raw.decode("utf-8", errors="replace").strip()
    if not re.fullmatch(r"[0-9]+", text):
        raise CheckpointError(f"{path}: expected a step number, found {ascii(text[:40])}")
    return int(text)


def resolve(directory: str, step: int | None = None) -> str:
    """The checkpoint directory for DIRECTORY (a save directory, or one checkpoint) and a step
    (default: the one `latest` names)."""
    if step is None and os.path.isfile(os.path.join(directory, INFO)):
        return directory
    if step is None:
        step = latest_step(directory)
        if step is None:
            if not os.path.isdir(directory):
                raise CheckpointError(f"{directory}: no such directory")
            raise CheckpointError(f"{directory}: no checkpoint here (no '{LATEST}' file)")
    path = os.path.join(directory, step_dirname(step))
    if not os.path.isdir(path):
        # a save of the same step again, killed between moving the old one aside and the new one in
        old = sorted(e for e in os.listdir(directory) if e.startswith(step_dirname(step) + ".old-")
                     and os.path.isfile(os.path.join(directory, e, INFO))) if os.path.isdir(directory) else []
        if not old:
            raise CheckpointError(f"{path}: no such checkpoint")
        path = os.path.join(directory, old[0])
    return path


def read_info(path: str) -> dict:
    """checkpoint.json of one checkpoint directory."""
    try:
        with open(os.path.join(path, INFO), encoding="utf-8") as f:
            info = json.load(f)
    except FileNotFoundError:
        raise CheckpointError(f"{path}: not a complete checkpoint (no {INFO}; an interrupted save?)") from None
    except IsADirectoryError:
        raise CheckpointError(f"{path}: {INFO} is a directory, not a checkpoint description") from None
    except OSError as e:
        raise CheckpointError(f"{path}: cannot read {INFO} ({e.strerror or e})") from None
    except (ValueError, UnicodeDecodeError, RecursionError) as e:
        raise CheckpointError(f"{path}: {INFO} is corrupt ({e})") from None
    if not isinstance(info, dict) or info.get("format") != FORMAT:
        raise CheckpointError(f"{path}: {INFO} is not a specc checkpoint description")
    if info.get("version") != VERSION:
        raise CheckpointError(f"{path}: checkpoint format version {info.get('version')}, this runtime reads {VERSION}")
    problem = _info_problem(info)
    if problem:
        raise CheckpointError(f"{path}: {INFO} is corrupt: {problem}")
    m = _SAVED_DIR.match(os.path.basename(os.path.normpath(path)))
    if m and int(m.group(1)) != info["step"]:  # `latest` names the directory, so it is checked too
        raise CheckpointError(f"{path}: {INFO} says step {info['step']}, but the checkpoint is step "
                              f"{int(m.group(1))} (its directory's name); an edited or misplaced {INFO}?")
    return info


def _info_problem(info: dict) -> str | None:
    """What is missing or mistyped in a checkpoint.json that is valid JSON (None: nothing)."""
    def count(v, least=0):
        return isinstance(v, int) and not isinstance(v, bool) and v >= least

    def shape(v):
        return isinstance(v, list) and all(count(d) for d in v)

    def text(v):
        return json.dumps(v)[:40]

    checks = [("step", lambda v: count(v), "a non-negative integer"),
              ("spec", lambda v: isinstance(v, dict) and all(isinstance(v.get(k), (str, type(None)))
                                                            for k in ("name", "sha256")),
               "an object with string 'name' and 'sha256'"),
              ("layout", lambda v: isinstance(v, dict) and all(count(v.get(k), 1) for k in ("tp", "cp", "dp", "pp")),
               "an object with positive integers 'tp', 'cp', 'dp', 'pp'"),
              ("params", lambda v: isinstance(v, dict), "an object of parameters"),
              ("files", lambda v: isinstance(v, dict), "an object of files"),
              ("optimizer", lambda v: v is None or (isinstance(v, dict) and isinstance(v.get("sharded", {}), dict)),
               "null or an object")]
    for key, ok, what in checks:
        if key not in info:
            return f"no '{key}'"
        if not ok(info[key]):
            return f"'{key}' must be {what}, found {text(info[key])}"
    for key in ("scheduler", "data", "rng"):
        if key in info and not isinstance(info[key], bool):
            return f"'{key}' must be true or false, found {text(info[key])}"
    for name, p in info["params"].items():
        if not isinstance(p, dict) or not shape(p.get("shape")) or not isinstance(p.get("dtype"), str) \
                or not isinstance(getattr(torch, p["dtype"], None), torch.dtype):
            return f"parameter {name!r} must have a 'shape' (a list of sizes) and a torch 'dtype', found {text(p)}"
    for fname, f in info["files"].items():
        if fname in ("", ".", "..") or "/" in fname or "\\" in fname:
            return f"file name {fname!r} is not a plain file name"
        if not isinstance(f, dict) or not count(f.get("bytes")) or not isinstance(f.get("crc32"), str):
            return f"file {fname!r} must have 'bytes' (an integer) and 'crc32' (a string), found {text(f)}"
    for key, entry in ((info["optimizer"] or {}).get("sharded", {})).items():
        if not isinstance(entry, dict) or not shape(entry.get("shape")):
            return f"optimizer state {key!r} must have a 'shape' (a list of sizes), found {text(entry)}"
    return None


def _verify_files(path: str, info: dict, world: _World, checksums: bool) -> None:
    problems = []
    for i, (fname, want) in enumerate(sorted(info["files"].items())):
        fpath = os.path.join(path, fname)
        if not os.path.isfile(fpath):
            problems.append(f"file {fname} is missing")
            continue
        size = os.path.getsize(fpath)
        if size != want["bytes"]:
            how = "truncated" if size < want["bytes"] else "longer than written"
            problems.append(f"file {fname} has {size} bytes, {want['bytes']} were written ({how})")
        elif checksums and i % world.size == world.rank and _crc32(fpath) != want["crc32"]:
            problems.append(f"file {fname} is corrupt (crc32 {_crc32(fpath)}, {want['crc32']} was written)")
    error = None
    if problems:
        more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
        error = f"{path}: {problems[0]}{more}"
    world.agree(error)
    world.agree(_unlisted_data(path, info))


def _unlisted_data(path: str, info: dict) -> str | None:
    """Every file that holds saved data must be listed in checkpoint.json (and so be checked):
    .metadata itself, and each file that .metadata places data in, with at least the bytes it
    places there. A file dropped from the list would otherwise load unchecked."""
    listed = info["files"]
    if DCP_METADATA not in listed:
        return f"{path}: file {DCP_METADATA} is not listed in {INFO} (an edited {INFO}?): it cannot be checked"
    try:
        metadata = dcp.read_metadata(path)
        ends = {}
        for item in metadata.storage_data.values():
            ends[item.relative_path] = max(ends.get(item.relative_path, 0), item.offset + item.length)
    except Exception as e:  # noqa: BLE001 - an unreadable .metadata is one line
        return f"{path}: cannot read {DCP_METADATA}: {_first_line(e)}"
    unlisted = sorted(f for f in ends if f not in listed)
    if unlisted:
        return (f"{path}: file {unlisted[0]} holds saved data ({DCP_METADATA} places blocks in it) but is not "
                f"listed in {INFO}, so it cannot be checked (an edited {INFO}?)"
                + (f" (and {len(unlisted) - 1} more)" if len(unlisted) > 1 else ""))
    short = sorted(f for f, end in ends.items() if listed[f]["bytes"] < end)
    if short:
        return (f"{path}: file {short[0]} is listed with {listed[short[0]]['bytes']} bytes, but {DCP_METADATA} "
                f"places data up to byte {ends[short[0]]}")
    return None


def check_spec(path: str, saved: dict, mine: dict, allow_spec_change: bool) -> None:
    if allow_spec_change or not saved.get("sha256") or not mine.get("sha256") or saved["sha256"] == mine["sha256"]:
        return
    raise CheckpointError(
        f"{path}: saved from spec {saved.get('name')} (sha256 {saved['sha256'][:16]}), but this model is spec "
        f"{mine.get('name')} (sha256 {mine['sha256'][:16]}); use the spec and --set overrides it was saved with, "
        f"or allow a spec change (allow_spec_change=True, --allow-spec-change) to load matching names and shapes")


def check_params(path: str, saved: dict, described: dict) -> None:
    missing = [n for n in described if n not in saved]
    extra = [n for n in saved if n not in described]
    shapes = [f"{n} is {saved[n]['shape']} in the checkpoint, {described[n]['shape']} in this model"
              for n in described if n in saved and saved[n]["shape"] != described[n]["shape"]]
    problems = []
    if missing:
        problems.append(f"{len(missing)} parameter(s) of this model are not in the checkpoint: {_some(missing)}")
    if extra:
        problems.append(f"{len(extra)} parameter(s) in the checkpoint are not in this model: {_some(extra)}")
    if shapes:
        problems.append(f"shapes differ: {_some(shapes)}")
    if problems:
        raise CheckpointError(f"{path}: the checkpoint does not match this model: " + "; ".join(problems))


def _some(items, n: int = 3) -> str:
    return ", ".join(items[:n]) + (f", ... ({len(items) - n} more)" if len(items) > n else "")


def load_checkpoint(directory: str, model: torch.nn.Module, pg: ProcessGroups | None = None, *,
                    step: int | None = None, optimizer_state=None, rng_tracker=None,
                    spec_sha256: str | None = None, spec_name: str | None = None,
                    allow_spec_change: bool = False, verify_checksums: bool = True) -> dict:
    """Load a checkpoint into `model` (in place) at this rank's layout; every rank calls it.

    directory: a save directory (loads the step `latest` names, or `step`) or one checkpoint.
    optimizer_state: a template shaped like what was saved: its ParamShard tensors (and plain
        tensors, on the same layout) are filled in place; omit it to load the model only.
    rng_tracker: restored (with torch's RNG state) when the layout is the one that saved.
    Before reading anything, every file is checked against the sizes and checksums recorded at
    save time, and the spec, parameter names and full shapes against the model: any mismatch
    raises CheckpointError naming it, and nothing is loaded.

    Returns {"step", "path", "optimizer_state" (the filled template, or None), "scheduler_state",
    "data_state", "config", "rng_restored", "saved_layout", "resharded", "spec"}.
    """
    pg = pg if pg is not None else ProcessGroups.single()
    world = _World()
    error, path, info = None, None, None
    try:
        path = resolve(directory, step)
        info = read_info(path)
    except CheckpointError as e:
        error = str(e)
    world.agree(error)
    _verify_files(path, info, world, verify_checksums)

    entries, described, params = _param_entries(model)
    everyone = _everyones(world, described)
    error = None
    try:
        check_spec(path, info["spec"], _spec_identity(model, spec_name, spec_sha256), allow_spec_change)
        check_params(path, info["params"], everyone)
    except CheckpointError as e:
        error = str(e)
    world.agree(error)

    same_layout = info["layout"] == _layout(pg)
    opt_entries, opt_local_paths, opt_repl_paths = {}, [], []
    error = None
    if optimizer_state is not None:
        try:
            opt_entries, opt_local_paths, opt_repl_paths = _plan_optimizer(path, info, optimizer_state, params,
                                                                           same_layout, _layout(pg))
        except (CheckpointError, ValueError) as e:
            error = str(e)
    world.agree(error)

    objects = {"replicated": None}
    if same_layout and info.get("rng", True):
        objects[f"rank/{world.rank:05d}"] = None
    try:
        dcp.load(path, objects)
        error = None
    except Exception as e:  # noqa: BLE001 - any failure to read is reported as one line
        error = f"{path}: reading the checkpoint failed: {_first_line(e)}"
    world.agree(error)
    replicated = objects["replicated"]
    local = objects.get(f"rank/{world.rank:05d}") or {}

    error = None
    saved_step = replicated.get("step")  # (absent in checkpoints saved before it was stored)
    if saved_step is not None and saved_step != info["step"]:
        error = (f"{path}: the saved data is of step {saved_step}, but {INFO} says step {info['step']} "
                 f"(an edited {INFO}?)")
    saved_opt_repl = (replicated.get("optimizer") or {})
    saved_opt_local = (local.get("optimizer") or {})
    for p in opt_repl_paths:
        if p not in saved_opt_repl:
            error = error or f"{path}: the checkpoint's optimizer state has no value at {_path_text(p)}"
    for p in opt_local_paths:
        if p not in saved_opt_local:
            error = error or f"{path}: the checkpoint's optimizer state has no rank-local value at {_path_text(p)}"
    world.agree(error)

    entries.update(opt_entries)
    try:
        dcp.load(path, entries)
        error = None
    except Exception as e:  # noqa: BLE001
        error = (f"{path}: reading the checkpoint failed, the model is partially loaded and must not be "
                 f"used: {_first_line(e)}")
    world.agree(error)

    result_opt = None
    if optimizer_state is not None:
        def fill(p, leaf):
            if isinstance(leaf, ParamShard):
                return leaf
            if isinstance(leaf, RankLocal):
                return RankLocal(saved_opt_local[p])
            if isinstance(leaf, torch.Tensor):
                saved = saved_opt_local[p]
                if isinstance(saved, torch.Tensor) and saved.shape == leaf.shape:
                    with torch.no_grad():
                        leaf.copy_(saved)
                    return leaf
                return saved
            return saved_opt_repl[p]
        result_opt = _rebuild(optimizer_state, fill)

    rng_restored = False
    if same_layout and "rng" in local:
        _set_rng_state(local["rng"], rng_tracker)
        rng_restored = True
    return {
        "step": info["step"], "path": path, "optimizer_state": result_opt,
        "scheduler_state": replicated.get("scheduler"), "data_state": replicated.get("data"),
        "config": info.get("config"), "rng_restored": rng_restored, "saved_layout": info["layout"],
        "resharded": not same_layout, "spec": info["spec"],
    }


def _first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0] if text else ''}"


def _plan_optimizer(path: str, info: dict, template, params: dict, same_layout: bool, layout: dict):
    saved = (info.get("optimizer") or {})
    if info.get("optimizer") is None:
        raise CheckpointError(f"{path}: the checkpoint has no optimizer state (load the model only: "
                              f"pass no optimizer_state)")
    sharded = saved.get("sharded", {})
    entries, local_paths, repl_paths = {}, [], []
    for p, leaf in _walk(template):
        if isinstance(leaf, ParamShard):
            key = _path_text(p)
            if key not in sharded:
                raise CheckpointError(f"{path}: the checkpoint has no optimizer state {key}")
            boxes = _shard_boxes(leaf, params)
            if list(boxes.shape) != sharded[key]["shape"]:
                raise CheckpointError(f"{path}: optimizer state {key} is {sharded[key]['shape']} in the checkpoint, "
                                      f"{list(boxes.shape)} here")
            entries[f"optimizer/{key}"] = boxes
        elif isinstance(leaf, (RankLocal, torch.Tensor)):
            if not same_layout:
                raise CheckpointError(
                    f"{path}: optimizer state {_path_text(p)} is rank-local, saved at {_describe(info['layout'])}; "
                    f"it cannot be loaded at {_describe(layout)} (give per-parameter tensors as ParamShard to "
                    f"reshard them)")
            local_paths.append(p)
        else:
            repl_paths.append(p)
    return entries, local_paths, repl_paths


def read_tensors(directory: str, names=None, step: int | None = None, verify_checksums: bool = True) -> dict:
    """Full tensors of the parameters of a checkpoint (all of them, or `names`), by name."""
    world = _World()
    path = resolve(directory, step)
    info = read_info(path)
    _verify_files(path, info, world, verify_checksums)
    names = list(info["params"]) if names is None else list(names)
    unknown = [n for n in names if n not in info["params"]]
    if unknown:
        raise CheckpointError(f"{path}: no parameter(s) {_some(unknown)} in the checkpoint")
    entries = {}
    for n in names:
        shape = tuple(info["params"][n]["shape"])
        dtype = getattr(torch, info["params"][n]["dtype"])
        entries[f"model/{n}"] = Boxes(shape, dtype, [((0,) * len(shape), torch.empty(shape, dtype=dtype))])
    entries["replicated"] = None
    try:
        dcp.load(path, entries)
    except Exception as e:  # noqa: BLE001
        raise CheckpointError(f"{path}: reading the checkpoint failed: {_first_line(e)}") from None
    saved_step = (entries["replicated"] or {}).get("step")
    if saved_step is not None and saved_step != info["step"]:
        raise CheckpointError(f"{path}: the saved data is of step {saved_step}, but {INFO} says step {info['step']} "
                              f"(an edited {INFO}?)")
    return {n: entries[f"model/{n}"].boxes[0][1] for n in names}
