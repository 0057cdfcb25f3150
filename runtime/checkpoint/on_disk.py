"""A save directory on disk: its names, writing a checkpoint atomically, the `latest` pointer,
pruning, and reading and checking a checkpoint's files before anything is loaded.

On disk (see docs/checkpoints.md):

    DIR/latest                   the step of the newest complete checkpoint ("1200\\n")
    DIR/step_0001200/            one checkpoint: DCP files, then checkpoint.json, written last
        .metadata                DCP: every entry, its full size and the blocks that were saved
        __0_0.distcp ...         DCP: one file per rank that wrote something
        checkpoint.json          step, spec, layout, parameter names and full shapes, config,
                                 and every file's size and crc32

A save writes into DIR/step_N.tmp-XXXX, syncs every file, writes checkpoint.json, renames the
directory to step_N, and only then replaces DIR/latest (write + fsync + os.replace). A save killed
at any point leaves the previous checkpoint and `latest` as they were.
"""

from __future__ import annotations

import errno
import json
import os
import re
import secrets
import shutil
import stat
import zlib

import torch

from ..files import check_replaceable, not_a_file, replace
from . import dcp
from .errors import CheckpointError
from .lock import SaveDirBusy, lock_for_save
from .world import _World

LATEST = "latest"
INFO = "checkpoint.json"
DCP_METADATA = ".metadata"  # DCP's index: every entry and the file, offset and length of each saved block
FORMAT = "specc-checkpoint"
VERSION = 1
_STEP_DIR = re.compile(r"step_(\d+)$")
_SAVED_DIR = re.compile(r"step_(\d+)(\.old-[0-9a-f]+)?$")  # a checkpoint's directory (one saved over: .old-)
_TEMP_DIR = re.compile(r"step_(\d+)\.(tmp|old|del)-[0-9a-f]+$")


def step_dirname(step: int) -> str:
    return f"step_{step:07d}"


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
    if not re.fullmatch(r"[0-9]{1,18}", text):  # (no run takes 10^18 steps: a longer one is not a step)
        raise CheckpointError(f"{path}: expected a step number, found {ascii(text[:40])}"
                              + ("..." if len(text) > 40 else ""))
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


def _first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0] if text else ''}"
