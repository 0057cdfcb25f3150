"""One run per save directory.

A run that saves into DIR holds an exclusive `fcntl.flock` on DIR/run.lock for as long as it runs
(`lock_save_dir`; under torchrun, rank 0 holds it: the rank that writes `latest` and prunes). The
operating system drops the lock when the process ends, however it ends, so a run killed with
SIGKILL leaves no stale lock behind. The file holds the holder's record (pid, host, elastic run
id), read back for the error that a second run gets:

    ckpt: in use by another run (pid 4242 on node7, since 2026-12-02 03:07:11 UTC) ...

`save_checkpoint` takes the lock for the time of one save when its process does not hold it, so
two programs that call the API on one directory cannot interleave their saves either.

The record stays in the file after the run (the lock does not): an elastic restart of the same
run (the same torchrun run id) reads it and knows the checkpoints in DIR are its own.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import socket
import stat
import time

from .errors import CheckpointError

LOCK = "run.lock"

_HELD: dict = {}  # realpath of a save directory -> the RunLock this process holds on it


class SaveDirBusy(CheckpointError):
    """Another process holds the save directory's lock: one line naming it."""


def run_identity() -> dict:
    """What this process records as the lock's holder: its pid and host, and under torchrun the
    elastic run id (the same for every restart of one job) and the agent's pid."""
    record = {"pid": os.getpid(), "host": socket.gethostname(),
              "since": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())}
    run = os.environ.get("TORCHELASTIC_RUN_ID")
    if run is not None:
        record["run"] = run
        record["agent"] = f"{socket.gethostname()}:{os.getppid()}"
    return record


def same_run(previous: dict | None, mine: dict) -> bool:
    """Whether `previous` (the record a holder left) was written by an earlier attempt of this
    elastic run. torchrun's run id is unique per job with --standalone or a --rdzv-id; its default
    "none" (static rendezvous) is shared by every job, so then the agent must be the same too."""
    if not isinstance(previous, dict) or not mine.get("run") or previous.get("run") != mine["run"]:
        return False
    return mine["run"] != "none" or previous.get("agent") == mine.get("agent")


def describe(record: dict | None) -> str:
    if not isinstance(record, dict) or "pid" not in record:
        return "another process"
    text = f"pid {record['pid']}"
    if record.get("host"):
        text += f" on {record['host']}"
    if record.get("since"):
        text += f", since {record['since']}"
    return text


class RunLock:
    """The lock on one save directory, held by this process until `release()` (or its end).

    previous: the record that the last holder left in the file (None: none), read when the lock
        was taken. `claim()` replaces it with this process's record.
    note: why no lock could be taken (a file system without flock), None when it is held."""

    def __init__(self, directory: str, fd: int | None, previous: dict | None, note: str | None = None):
        self.directory = directory
        self.fd = fd
        self.previous = previous
        self.note = note
        self._key = os.path.realpath(directory)
        if fd is not None:
            _HELD[self._key] = self

    def claim(self, record: dict | None = None) -> None:
        """Write this process's record (run_identity(), or `record`) into the lock file."""
        if self.fd is None:
            return
        text = json.dumps(record if record is not None else run_identity()) + "\n"
        os.ftruncate(self.fd, 0)
        os.pwrite(self.fd, text.encode(), 0)
        os.fsync(self.fd)

    def release(self) -> None:
        if self.fd is None:
            return
        if _HELD.get(self._key) is self:
            del _HELD[self._key]
        fd, self.fd = self.fd, None
        os.close(fd)  # closing the last descriptor drops the flock

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.release()


def _read_record(fd: int) -> dict | None:
    try:
        raw = os.pread(fd, 4096, 0)
        record = json.loads(raw.decode("utf-8"))
    except (OSError, ValueError, UnicodeDecodeError):
        return None
    return record if isinstance(record, dict) else None


def _open(path: str, create: bool) -> int | None:
    """A descriptor of the lock file (a regular file only: never a link, a FIFO or a device);
    None when it does not exist and `create` is False."""
    flags = os.O_RDWR | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0)
    if create:
        flags |= os.O_CREAT
    try:
        fd = os.open(path, flags, 0o644)
    except FileNotFoundError:
        if create:
            raise
        return None
    except OSError as e:
        if e.errno in (errno.ELOOP, errno.ENXIO, errno.EISDIR):
            raise CheckpointError(f"{path}: not a regular file (the lock of the save directory); remove it") from None
        raise CheckpointError(f"{path}: cannot open the lock of the save directory ({e.strerror or e})") from None
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise CheckpointError(f"{path}: not a regular file (the lock of the save directory); remove it")
    return fd


def _busy(directory: str, fd: int) -> SaveDirBusy:
    return SaveDirBusy(f"{directory}: in use by another run ({describe(_read_record(fd))}, which holds "
                       f"{os.path.join(directory, LOCK)}); a save directory belongs to one run at a time: wait "
                       f"for it to end, or save into another directory")


def lock_save_dir(directory: str) -> RunLock:
    """Take the lock of save directory DIRECTORY (created if needed) without waiting: a RunLock,
    or SaveDirBusy naming the process that holds it. On a file system without flock, the lock
    comes back unheld with its `note` saying so."""
    key = os.path.realpath(directory)
    if key in _HELD:
        raise SaveDirBusy(f"{directory}: this process already holds its lock (one run per save directory)")
    os.makedirs(directory, exist_ok=True)
    path = os.path.join(directory, LOCK)
    fd = _open(path, create=True)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        error = _busy(directory, fd)
        os.close(fd)
        raise error from None
    except OSError as e:  # ENOLCK, EOPNOTSUPP, ENOSYS: a file system that does not lock
        os.close(fd)
        return RunLock(directory, None, None, note=f"{path}: cannot be locked here ({e.strerror or e}); nothing "
                                                   f"keeps a second run from saving into {directory}")
    return RunLock(directory, fd, _read_record(fd))


def check_free(directory: str) -> None:
    """Raise SaveDirBusy when another process holds DIRECTORY's lock; creates nothing."""
    if os.path.realpath(directory) in _HELD:
        return
    path = os.path.join(directory, LOCK)
    fd = _open(path, create=False) if os.path.isdir(directory) else None
    if fd is None:
        return
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        raise _busy(directory, fd) from None
    except OSError:
        pass  # no locks on this file system
    finally:
        os.close(fd)  # (and with it the lock, if the probe took it)


def held(directory: str) -> bool:
    """Whether this process holds DIRECTORY's lock."""
    return os.path.realpath(directory) in _HELD


def lock_for_save(directory: str) -> RunLock | None:
    """For one save: None when this process holds the directory's lock already (a run does),
    else the lock taken until the save ends (SaveDirBusy when another process holds it)."""
    if held(directory):
        return None
    return lock_save_dir(directory)
