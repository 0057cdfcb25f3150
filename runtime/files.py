"""Writing files beside what a user keeps there: a writer of the runtime only ever replaces (or
appends to) a regular file, or puts a new one where nothing is. Anything else at the path (a FIFO,
a device node, a socket, a folder, a symbolic link, even one to a regular file) is refused with one
line naming the path and what it is, and nothing is written: os.replace over a device node would
replace the node itself with a file, open() of a FIFO blocks until a reader comes, and a link
would send the bytes somewhere the user did not name.

specc/files.py holds the same check for the compiler's writers (specc imports nothing of the
runtime, which imports torch); tests/specc/test_files.py checks that the two agree."""

from __future__ import annotations

import os
import stat
import tempfile

_KINDS = ((stat.S_ISLNK, "a symbolic link"), (stat.S_ISDIR, "a folder"), (stat.S_ISFIFO, "a FIFO (named pipe)"),
          (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"))


class NotARegularFile(OSError):
    """A writer refused its path: str() is one line naming the path and what is there."""


def not_a_file(path: str) -> str | None:
    """What is at `path` when a writer must leave it alone ('a FIFO (named pipe)', 'a symbolic link
    to X', ...); None when nothing is there or a regular file is."""
    try:
        mode = os.lstat(path).st_mode
    except (FileNotFoundError, NotADirectoryError):  # nothing there (a missing parent: the write says so)
        return None
    if stat.S_ISREG(mode):
        return None
    name = kind_of_mode(mode)
    if name == "a symbolic link":
        try:
            return f"{name} (to {os.readlink(path)})"
        except OSError:
            return name
    return name


def kind_of_mode(mode: int) -> str:
    """'a regular file', 'a FIFO (named pipe)', 'a character device', ... for an st_mode."""
    if stat.S_ISREG(mode):
        return "a regular file"
    for test, name in _KINDS:
        if test(mode):
            return name
    return "not a regular file"


def check_replaceable(path: str) -> None:
    """Raise NotARegularFile unless a writer may put a regular file at `path`."""
    if not path:
        raise NotARegularFile("the output path is empty")
    what = not_a_file(path)
    if what is not None:
        raise NotARegularFile(f"{path} is {what}, not a regular file: only regular files are replaced, "
                              "and it is left as it is")


def open_to_write(path: str, mode: str = "w", encoding: str | None = "utf-8"):
    """open(path, mode) for writing ('w', 'a', 'wb', 'ab'), for a regular file only: it never follows
    a symbolic link, never blocks on a FIFO and never opens a device (the file is opened
    non-blocking without following links, and checked, before it is truncated)."""
    if not mode.startswith(("w", "a")):
        raise ValueError(f"open_to_write: mode {mode!r} does not write")
    check_replaceable(path)
    flags = os.O_WRONLY | os.O_CREAT | (os.O_APPEND if mode.startswith("a") else 0)
    for name in ("O_NOFOLLOW", "O_NONBLOCK", "O_CLOEXEC"):
        flags |= getattr(os, name, 0)
    try:
        fd = os.open(path, flags, 0o666)
    except OSError as e:
        what = not_a_file(path)  # it changed since the check (ELOOP: now a link; ENXIO: a FIFO)
        if what is not None:
            raise NotARegularFile(f"{path} is {what}, not a regular file: only regular files are replaced, "
                                  "and it is left as it is") from None
        raise e from None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise NotARegularFile(f"{path} is not a regular file: only regular files are replaced, and it is "
                                  "left as it is")
        os.set_blocking(fd, True)
        if mode.startswith("w"):
            os.ftruncate(fd, 0)
        return os.fdopen(fd, mode, **({} if "b" in mode else {"encoding": encoding}))
    except BaseException:
        os.close(fd)
        raise


def write_atomically(path: str, data, durable: bool = False) -> None:
    """Write `data` (str: UTF-8, or bytes) to a temporary file beside `path` and rename it over
    `path`: readers see the old file or the new one, never half. durable: fsync before the rename."""
    check_replaceable(path)
    fd, tmp = tempfile.mkstemp(dir=os.path.dirname(os.path.abspath(path)),
                               prefix=f".{os.path.basename(path)}.tmp-")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data.encode("utf-8") if isinstance(data, str) else data)
            if durable:
                f.flush()
                os.fsync(f.fileno())
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)  # mkstemp makes it private
        replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


def replace(tmp: str, path: str) -> None:
    """os.replace(tmp, path), when `path` is nothing or a regular file (checked just before)."""
    check_replaceable(path)
    os.replace(tmp, path)
