"""Writing output files the way users expect: whole or not at all, with the usual permissions,
and only ever over a regular file. Anything else at the path (a FIFO, a device node, a socket, a
folder, a symbolic link, even one to a regular file) is refused with one line naming the path and
what it is, and nothing is written: os.replace over a device node would replace the node itself,
and a link would send the bytes somewhere the user did not name.

runtime/files.py holds the same check for the runtime's writers (specc imports nothing of the
runtime, which imports torch); tests/specc/test_files.py checks that the two agree."""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import stat
import sys
import tempfile

from .errors import Loc, SpecError

_KINDS = ((stat.S_ISLNK, "a symbolic link"), (stat.S_ISDIR, "a folder"), (stat.S_ISFIFO, "a FIFO (named pipe)"),
          (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"))


def not_a_file(path: str) -> str | None:
    """What is at `path` when a writer must leave it alone ('a FIFO (named pipe)', 'a symbolic link
    (to X)', ...); None when nothing is there or a regular file is."""
    try:
        mode = os.lstat(path).st_mode
    except (FileNotFoundError, NotADirectoryError):  # nothing there (a missing parent: the write says so)
        return None
    if stat.S_ISREG(mode):
        return None
    for test, name in _KINDS:
        if test(mode):
            if name == "a symbolic link":
                try:
                    return f"{name} (to {os.readlink(path)})"
                except OSError:
                    return name
            return name
    return "not a regular file"


def check_replaceable(path: str, flag: str = "") -> None:
    """Raise a SpecError (one line) unless a writer may put a regular file at `path`. flag: the
    option that named the path, for the message (e.g. '-o')."""
    if not path:
        raise SpecError(Loc(flag or "output"), "the output path is empty", "give the file to write")
    what = not_a_file(path)
    if what is not None:
        raise SpecError(Loc(path), f"is {what}, not a regular file: specc replaces only regular files, and left "
                        "it as it is", "give another path")


def atomic_write(path: str, write) -> None:
    """write(binary file) into a temp file beside `path`, then rename it over `path` (a regular
    file or nothing: checked before and just before the rename): readers never see half."""
    check_replaceable(path)
    fd, tmp = tempfile.mkstemp(dir=os.path.dirname(os.path.abspath(path)), prefix=".specc-")
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
        make_public(tmp)
        check_replaceable(path)  # again: it may have changed while we wrote
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def make_public(path: str, base: int = 0o666) -> None:
    """Give a temp file (0600) or folder (0700, with base 0o777) the permissions the umask allows."""
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(path, base & ~umask)


def atomic_write_text(path: str, text: str) -> None:
    """Write to a temp file beside `path`, then rename it over `path`: readers never see half
    (atomic_write, UTF-8)."""
    atomic_write(path, lambda f: f.write(text.encode("utf-8")))


@contextlib.contextmanager
def locked_folder(path: str):
    """Hold an exclusive lock on the folder `path` (flock on the folder itself: no lock file is
    left behind, and the kernel releases it when the process dies). Where fcntl is missing, no lock."""
    try:
        import fcntl
    except ImportError:  # not POSIX
        yield
        return
    fd = os.open(path, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # releases the lock


def swap_folder(new: str, target: str) -> None:
    """Put the folder `new` at `target` (a sibling path), replacing the folder there if any.
    On Linux the two are exchanged atomically (renameat2 RENAME_EXCHANGE), so `target` never
    disappears; elsewhere the old folder is renamed away first (callers hold locked_folder on the
    parent, so two writers never interleave). The old folder is removed afterwards."""
    if not os.path.lexists(target):
        os.rename(new, target)
        return
    if _exchange(new, target):
        shutil.rmtree(new, ignore_errors=True)  # `new` now holds the old folder
        return
    old = new + ".old"
    os.rename(target, old)
    try:
        os.rename(new, target)
    except BaseException:
        os.rename(old, target)
        raise
    shutil.rmtree(old, ignore_errors=True)


_AT_FDCWD, _RENAME_EXCHANGE = -100, 2  # <fcntl.h>, <linux/fs.h>


def _exchange(a: str, b: str) -> bool:
    """Swap two paths atomically; False where the system or the file system cannot."""
    if not sys.platform.startswith("linux"):
        return False
    import ctypes

    try:
        renameat2 = ctypes.CDLL(None, use_errno=True).renameat2  # glibc 2.28+
    except (OSError, AttributeError):
        return False
    renameat2.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    renameat2.restype = ctypes.c_int
    if renameat2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP, errno.EPERM):  # not supported here
        return False
    raise OSError(err, os.strerror(err), b)
