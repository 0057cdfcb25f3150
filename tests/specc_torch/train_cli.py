"""What the `specc train` command-line tests here share: the tiny spec, small run flags, a
corpus, and the check that an error is one line."""

from __future__ import annotations

import os

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
GPT_TINY = os.path.join(ROOT, "specs", "gpt-tiny.yaml")
SMALL = ("--micro-batch-size", "2", "--global-batch-size", "2", "--eval-iters", "0", "--log-interval", "1",
         "--no-progress")


def small_corpus(directory) -> str:
    """Four standard-library files, byte-tokenized, as DIRECTORY/corpus."""
    from runtime.data import prepare, stdlib_files

    out = str(directory / "corpus")
    prepare(stdlib_files(limit=4), "byte", out)
    return out


def one_error_line(err: str) -> str:
    """The one line of stderr (the launcher's "launching ..." aside): no traceback, no torchrun
    ChildFailedError."""
    lines = [line for line in err.splitlines() if not line.startswith("launching ")]
    assert len(lines) == 1, err
    assert "Traceback" not in err and "ChildFailedError" not in err, err
    return lines[0]
