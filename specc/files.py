"""Writing output files the way users expect: whole or not at all, with the usual permissions."""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import sys
import tempfile


def make_public(path: str, base: int = 0o666) -> None:
    """Give a temp file (0600) or folder (0700, with base 0o777) the permissions the umask allows."""
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(path, base & ~umask)


def atomic_write_text(path: str, text: str) -> None:
    """Write to a temp file beside `path`, then rename it over `path`: readers never see half."""
    fd, tmp = tempfile.mkstemp(dir=os.path.dirname(os.path.abspath(path)), prefix=".specc-")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        make_public(tmp)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


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
