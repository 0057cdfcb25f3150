"""Writing output files the way users expect: whole or not at all, with the usual permissions."""

from __future__ import annotations

import os
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
