"""docs/benchmarks.md: each benchmark replaces its own `## ` section and leaves the others (no torch)."""

from __future__ import annotations

import os


def replace_section(path: str, section: str) -> None:
    """Replace the section of `path` whose heading is `section`'s first line (or append it), the
    other sections kept; written whole to PATH.tmp, then renamed over it."""
    text = open(path, encoding="utf-8").read() if os.path.exists(path) else "# Benchmarks\n"
    title = section.splitlines()[0]
    start = text.find("\n" + title + "\n")
    if start >= 0:
        end = text.find("\n## ", start + 1)
        text = text[:start + 1] + section + (text[end:] if end >= 0 else "")
    else:
        text = text.rstrip("\n") + "\n\n" + section
    tmp = path + ".tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
    os.replace(tmp, path)


def load_line() -> str:
    """The host's load average, for a benchmark's doc line (a loaded host measures the other jobs too)."""
    try:
        return "load average " + " ".join(open("/proc/loadavg").read().split()[:3])
    except OSError:
        return "load average unknown"
