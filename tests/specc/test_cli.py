"""The command line: help, version, exit codes, one-line errors, and no torch for compiler commands."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from specc import __version__
from specc.cli import main

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))


def run(*args, **kw):
    return subprocess.run([sys.executable, "-m", "specc", *args], cwd=ROOT, capture_output=True, text=True, **kw)


def test_version_and_help(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0 and capsys.readouterr().out.strip() == f"specc {__version__}"
    for command in ("validate", "schema", "plan", "diff", "graph", "compile", "check", "verify"):
        with pytest.raises(SystemExit) as e:
            main([command, "--help"])
        assert e.value.code == 0
        assert "usage: specc " + command in capsys.readouterr().out


@pytest.mark.parametrize("command", ["plan", "compile", "graph", "validate"])
def test_compiler_commands_never_import_torch(command, tmp_path):
    args = {"compile": ["-o", str(tmp_path)], "graph": ["-o", str(tmp_path / "g.dot")]}.get(command, [])
    result = run("-X", "importtime", "-m", "specc", command, "specs/gpt.yaml", "--tp", "2", "--sp", *args) \
        if False else subprocess.run([sys.executable, "-X", "importtime", "-m", "specc", command, "specs/gpt.yaml",
                                      "--tp", "2", "--sp", *args], cwd=ROOT, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-2000:]
    imported = [ln for ln in result.stderr.splitlines() if ln.startswith("import time:")]
    assert imported, "importtime printed nothing"
    assert not [ln for ln in imported if ln.split("|")[-1].strip().split(".")[0] == "torch"]


def test_bad_spec_is_one_line_and_exit_2(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: x\nmodules: {}\n")
    result = run("plan", str(bad))
    assert result.returncode == 2
    assert result.stderr.count("\n") == 1 and "Traceback" not in result.stderr
    assert result.stderr.startswith(f"{bad}:1:1: error: missing required key 'model'")


def test_bad_flags_are_located(capsys):
    assert main(["plan", "specs/gpt-tiny.yaml", "--set", "hidden_sise=2"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("--set hidden_sise=2: error: unknown config value 'hidden_sise'")
    assert "did you mean 'hidden_size'" in err
    assert main(["plan", "specs/gpt-tiny.yaml", "--tp", "0"]) == 2


def test_graph_writes_dot_with_distinct_boundaries(tmp_path, capsys):
    out = tmp_path / "g.dot"
    assert main(["graph", os.path.join(ROOT, "specs", "gpt-tiny.yaml"), "--tp", "2", "--sp", "-o", str(out)]) == 0
    dot = out.read_text()
    assert dot.startswith('digraph "gpt_tiny"')
    assert dot.count("shape=diamond") == 6  # embedding RS, position scatter, attention and MLP RS in 2 layers
    assert "reduce_scatter_to_sequence_parallel_region" in dot


def test_schema_lists_every_op(capsys):
    import json

    from specc.ops import SPEC_OPS

    assert main(["schema"]) == 0
    schema = json.loads(capsys.readouterr().out)
    assert {f"op_{n}" for n in SPEC_OPS} <= set(schema["$defs"])
