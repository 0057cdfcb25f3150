"""The malformed-spec corpus: every `NN_name.yaml` here must fail `specc validate` with exactly the
one-line message in `NN_name.expected` (extra flags in `NN_name.args`), quickly and without a
traceback. Files under `extends/` are helpers that cases extend, not cases themselves."""

from __future__ import annotations

import contextlib
import io
import os
import resource
import shlex
import subprocess
import sys
import time
from pathlib import Path

import pytest

from specc_cli.main import main

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[2]
CASES = sorted(p.stem for p in HERE.glob("[0-9][0-9]*_*.yaml"))  # NN_name or NNN_name
BOMBS = ["billion_laughs", "string_alias_bomb", "deep_nesting_flow", "deep_nesting_block"]
# CPU seconds, not wall-clock: a bomb burns CPU however busy the machine is, and a busy machine
# (the rest of the suite, another job) stretches the wall clock of a process that is fine.
MAX_SECONDS = 2.0
MAX_MEMORY = 512 << 20  # address space of a validating process in the bounded-memory checks


def _args(case: str) -> list:
    extra = HERE / f"{case}.args"
    return shlex.split(extra.read_text()) if extra.exists() else []


def _validate(argv: list) -> tuple:
    """Run the CLI in-process from the repository root: (exit code, stdout, stderr, CPU seconds)."""
    out, err = io.StringIO(), io.StringIO()
    cwd = os.getcwd()
    os.chdir(ROOT)
    try:
        start = time.process_time()
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            code = main(["validate", *argv])
        seconds = time.process_time() - start
    finally:
        os.chdir(cwd)
    return code, out.getvalue(), err.getvalue(), seconds


def test_corpus_is_complete():
    assert len(CASES) >= 45
    numbers = [c.split("_")[0] for c in CASES]
    assert len(set(numbers)) == len(numbers), "two cases share a number"
    for case in CASES:
        assert (HERE / f"{case}.expected").exists(), f"{case}.yaml has no .expected"
    for expected in HERE.glob("*.expected"):
        assert (HERE / f"{expected.stem}.yaml").exists(), f"{expected.name} has no .yaml"


@pytest.mark.parametrize("case", CASES)
def test_case(case):
    expected = (HERE / f"{case}.expected").read_text(encoding="utf-8").rstrip("\n")
    code, out, err, seconds = _validate([f"tests/specc/errors/{case}.yaml", *_args(case)])
    assert code == 2
    assert out == ""
    assert err.endswith("\n") and err.count("\n") == 1, f"stderr is not one line: {err!r}"
    assert err.rstrip("\n") == expected
    assert "Traceback" not in err
    assert seconds < MAX_SECONDS


def _limit_memory():  # runs in the child before exec
    resource.setrlimit(resource.RLIMIT_AS, (MAX_MEMORY, MAX_MEMORY))


def _children_cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def _run_bounded(argv: list, cwd=ROOT):
    """(the finished process, the CPU seconds it used): `specc validate` in a process whose
    address space is capped."""
    start = _children_cpu_seconds()
    proc = subprocess.run([sys.executable, "-m", "specc_cli", "validate", *argv], cwd=cwd, capture_output=True,
                          text=True, timeout=30, preexec_fn=_limit_memory)
    return proc, _children_cpu_seconds() - start


def test_end_to_end_subprocess():
    """One case through a real process: exit status 2, one line on stderr, no traceback."""
    case = next(c for c in CASES if c.endswith("unknown_top_key"))
    proc, _ = _run_bounded([f"tests/specc/errors/{case}.yaml"])
    assert proc.returncode == 2
    assert proc.stdout == ""
    assert proc.stderr == (HERE / f"{case}.expected").read_text(encoding="utf-8")


@pytest.mark.parametrize("bomb", BOMBS)
def test_bombs_are_refused_in_bounded_memory(bomb):
    """Expansion and nesting bombs fail fast in a process whose address space is capped."""
    case = next(c for c in CASES if c.endswith(bomb))
    proc, seconds = _run_bounded([f"tests/specc/errors/{case}.yaml"])
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr == (HERE / f"{case}.expected").read_text(encoding="utf-8")
    assert seconds < MAX_SECONDS + 1.0  # includes interpreter start-up


def test_huge_file(tmp_path):
    """A file over 1 MiB is refused before it is parsed (generated here, not committed)."""
    spec = tmp_path / "huge.yaml"
    base = (ROOT / "specs" / "gpt-tiny.yaml").read_text()
    with open(spec, "w") as f:
        f.write(base)
        line = "# " + "padding " * 16 + "\n"
        while f.tell() <= (1 << 20):
            f.write(line)
    code, out, err, seconds = _validate([str(spec)])
    assert code == 2
    assert err == f"{spec}: error: file is larger than 1048576 bytes (a spec is a short text file)\n"
    assert seconds < MAX_SECONDS
    proc, seconds = _run_bounded([str(spec)])
    assert proc.returncode == 2 and proc.stderr == err
    assert seconds < MAX_SECONDS + 1.0


def _long_config(tmp_path, name: str, size: int):
    """A spec extending gpt.yaml with `size` bytes of config values, each an interpolation."""
    lines = ["name: big", "extends: gpt.yaml", "config:"]
    written, i = 0, 0
    while written < size:
        line = f"  extra_value_{i}: ${{hidden_size * {i} // 7 + max(1, num_layers)}}"
        lines.append(line)
        written += len(line) + 1
        i += 1
    spec = tmp_path / name
    spec.write_text("\n".join(lines) + "\n")
    return spec


def _validate_cpu_seconds(spec) -> float:
    """CPU time of this process validating `spec` (not wall time: other processes' load on the
    machine does not count)."""
    start = time.process_time()
    code, out, err, _ = _validate([str(spec)])
    assert code == 0 and out.startswith(f"{spec}: ok: big:"), err
    return time.process_time() - start


def test_large_file_under_the_limit_is_fast(tmp_path):
    """Just under 1 MiB of real content (a long config, ~15,000 interpolated values) validates,
    in time linear in its size: 8 times the content may cost at most 3 x 8 times the CPU time
    (a quadratic step would cost ~64 times). CPU time, and a ratio on the same machine, so that
    neither a slow machine nor a loaded one fails it."""
    (tmp_path / "gpt.yaml").write_text((ROOT / "specs" / "gpt.yaml").read_text())
    spec = _long_config(tmp_path, "big.yaml", 1000_000)
    assert spec.stat().st_size < (1 << 20)
    small = _long_config(tmp_path, "small.yaml", 1000_000 // 8)
    small_seconds = min(_validate_cpu_seconds(small) for _ in range(2))  # the first also warms caches
    assert _validate_cpu_seconds(spec) < 3 * 8 * small_seconds
