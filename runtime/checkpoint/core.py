"""Sharded, resharding, atomic checkpoints: save_checkpoint, load_checkpoint, and plain tensors
(save_tensors, read_tensors). The save directory on disk (its layout, the atomic write, the
`latest` pointer) is on_disk.py; what is stored, state.py; every rank's part, world.py; the
format, docs/checkpoints.md.
"""

from __future__ import annotations

import torch

from ..parallel_state import ProcessGroups
from . import dcp
from .boxes import Boxes
from .errors import CheckpointError
from .on_disk import (
    FORMAT,
    INFO,
    VERSION,
    _first_line,
    _verify_files,
    _write,
    read_info,
    resolve,
)
from .state import (
    ParamShard,
    RankLocal,
    _check_plain,
    _describe,
    _dtype_name,
    _everyones,
    _jsonable,
    _layout,
    _param_entries,
    _path_text,
    _rebuild,
    _rng_state,
    _same,
    _set_rng_state,
    _shard_boxes,
    _spec_identity,
    _split_state,
    _walk,
)
from .world import _World


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
                 spec_name: str | None = None, config=None, keep_last: int | None = None, optimizer: dict | None = None,
                 scheduler_state=None, data_state=None) -> str:
    """A checkpoint of full tensors by parameter name, from one process (e.g. an imported model):
    loadable by load_checkpoint at any TP/DP layout. optimizer: {"step": n, STATE: {parameter:
    full tensor}} (e.g. exp_avg, exp_avg_sq, master), stored as adam_state's ParamShards are, so
    that load_checkpoint(optimizer_state=adam_state(...)) fills an optimizer at any layout."""
    world = _World()
    entries, described, opt_described = {}, {}, {}
    for name, t in tensors.items():
        t = t.detach().contiguous()
        entries[f"model/{name}"] = Boxes(tuple(t.shape), t.dtype, [((0,) * t.dim(), t)])
        described[name] = {"shape": list(t.shape), "dtype": _dtype_name(t.dtype)}
    for state, per_param in (optimizer or {}).items():
        if state == "step":
            continue
        for name, t in per_param.items():
            if name not in tensors or tuple(t.shape) != tuple(tensors[name].shape):
                raise ValueError(f"optimizer state {state}/{name} has no parameter of its shape")
            t = t.detach().contiguous()
            entries[f"optimizer/{state}/{name}"] = Boxes(tuple(t.shape), t.dtype, [((0,) * t.dim(), t)])
            opt_described[f"{state}/{name}"] = {"param": name, "shape": list(t.shape), "dtype": _dtype_name(t.dtype)}
    _check_plain(scheduler_state, "scheduler_state")
    _check_plain(data_state, "data_state")
    entries["replicated"] = {"optimizer": {("step",): int(optimizer["step"])} if optimizer else None,
                             "scheduler": scheduler_state, "data": data_state, "step": step}
    info = {
        "format": FORMAT, "version": VERSION, "step": step,
        "spec": {"name": spec_name, "sha256": spec_sha256},
        "layout": _layout(ProcessGroups.single()),
        "params": described, "optimizer": {"sharded": opt_described} if optimizer else None,
        "scheduler": scheduler_state is not None, "data": data_state is not None, "rng": False,
        "config": _jsonable(config), "torch": torch.__version__,
    }
    return _write(directory, step, entries, info, world, keep_last)


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


def _saved_names(path: str) -> set:
    """The top-level names the checkpoint's data holds (its .metadata's), empty where unreadable
    (reading the data then fails with its own line)."""
    try:
        return set(dcp.read_metadata(path).state_dict_metadata)
    except Exception:  # noqa: BLE001
        return set()


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
    # this rank's own entry (its RNG states): read whenever the data holds it, so that a checkpoint.json
    # edited to say it has none is caught below rather than silently resuming from fresh streams
    if same_layout and (info.get("rng", True) or f"rank/{world.rank:05d}" in _saved_names(path)):
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
    if "rng" in local and not info.get("rng", True):
        error = error or (f"{path}: the saved data holds this rank's RNG states, but {INFO} says it has none (an "
                          f"edited {INFO}?)")
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
    entries = _load_whole(path, {f"model/{n}": info["params"][n] for n in names})
    saved_step = (entries["replicated"] or {}).get("step")
    if saved_step is not None and saved_step != info["step"]:
        raise CheckpointError(f"{path}: the saved data is of step {saved_step}, but {INFO} says step {info['step']} "
                              f"(an edited {INFO}?)")
    return {n: entries[f"model/{n}"].boxes[0][1] for n in names}


def _load_whole(path: str, described: dict) -> dict:
    """{key: Boxes holding the whole tensor} for each {key: {"shape", "dtype"}} of the checkpoint
    at `path`, read in one dcp.load, with its "replicated" values; a failure is one line."""
    entries = {}
    for key, d in described.items():
        shape, dtype = tuple(d["shape"]), getattr(torch, d["dtype"])
        entries[key] = Boxes(shape, dtype, [((0,) * len(shape), torch.empty(shape, dtype=dtype))])
    entries["replicated"] = None
    try:
        dcp.load(path, entries)
    except Exception as e:  # noqa: BLE001
        raise CheckpointError(f"{path}: reading the checkpoint failed: {_first_line(e)}") from None
    return entries


def read_optimizer_tensors(directory: str, step: int | None = None, verify_checksums: bool = True) -> dict | None:
    """The per-parameter optimizer state of a checkpoint at full shape, {"step": the optimizer's
    step count, STATE: {parameter: tensor}} (adam_state's names: exp_avg, exp_avg_sq, master;
    SGD's momentum_buffer), or None where it holds none."""
    world = _World()
    path = resolve(directory, step)
    info = read_info(path)
    if info.get("optimizer") is None:
        return None
    _verify_files(path, info, world, verify_checksums)
    sharded = info["optimizer"].get("sharded") or {}
    entries = _load_whole(path, {f"optimizer/{key}": d for key, d in sharded.items()})
    saved = (entries["replicated"] or {}).get("optimizer") or {}
    out = {"step": saved.get(("step",))}
    for key, d in sharded.items():
        state = key.split("/", 1)[0]
        out.setdefault(state, {})[d["param"]] = entries[f"optimizer/{key}"].boxes[0][1]
    return out
