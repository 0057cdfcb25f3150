"""The command line: help, version, exit codes, one-line errors, and no torch for compiler commands."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from specc import __version__
from specc_cli.main import main

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))


def run(*args, **kw):
    return subprocess.run([sys.executable, "-m", "specc_cli", *args], cwd=ROOT, capture_output=True, text=True, **kw)


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
    result = run("-X", "importtime", "-m", "specc_cli", command, "specs/gpt.yaml", "--tp", "2", "--sp", *args) \
        if False else subprocess.run([sys.executable, "-X", "importtime", "-m", "specc_cli", command, "specs/gpt.yaml",
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


def test_graph_nests_submodules_inside_their_parent(tmp_path):
    out, again = tmp_path / "g.dot", tmp_path / "h.dot"
    spec = os.path.join(ROOT, "specs", "gpt-tiny.yaml")
    assert main(["graph", spec, "-o", str(out)]) == 0
    assert main(["graph", spec, "-o", str(again)]) == 0
    dot = out.read_text()
    assert dot == again.read_text()  # deterministic
    lines = dot.splitlines()
    depth, inside = 0, {}
    for ln in lines:  # the depth of cluster each labelled module sits in
        if ln.lstrip().startswith(("subgraph ", "digraph ")):
            depth += 1
        elif ln.strip() == "}":
            depth -= 1
        elif ln.lstrip().startswith("label=") and "style=rounded" in ln:
            inside.setdefault(ln.split('"')[1], set()).add(depth)
    assert depth == 0  # every brace closed
    assert inside["self_attention (SelfAttention)"] == {3} and inside["mlp (MLP)"] == {3}  # inside layers.N
    assert dot.count('subgraph "cluster_') == len(set(ln for ln in lines if 'subgraph "cluster_' in ln))


def test_schema_lists_every_op(capsys):
    import json

    from specc.ops import SPEC_OPS

    assert main(["schema"]) == 0
    schema = json.loads(capsys.readouterr().out)
    assert {f"op_{n}" for n in SPEC_OPS} <= set(schema["$defs"])


# -- one line, never a traceback ------------------------------------------------------------------

GPT_TINY = os.path.join(ROOT, "specs", "gpt-tiny.yaml")


def _one_line(capsys, argv, starts: str) -> str:
    """main(argv) exits 2 with exactly one stderr line that starts with `starts`; returns it."""
    assert main([str(a) for a in argv]) == 2
    captured = capsys.readouterr()
    err = captured.err
    assert err.count("\n") == 1 and err.endswith("\n"), f"not one line: {err!r}"
    assert err.startswith(starts), err
    assert "Traceback" not in err and "usage:" not in err and captured.out == ""
    return err.rstrip("\n")


def test_argument_errors_are_one_line_with_a_hint(capsys):
    err = _one_line(capsys, ["plan", GPT_TINY, "--tp", "x"], "error: argument --tp/--tensor-model-parallel-size: "
                    "invalid int value: 'x'")
    assert err.endswith("(hint: see specc plan --help)")
    err = _one_line(capsys, ["plan", GPT_TINY, "--bogus", "3"], "error: unrecognized arguments: --bogus 3")
    assert err.endswith("(hint: see specc plan --help)")  # the command's help, though the top parser saw it
    _one_line(capsys, ["compile"], "error: the following arguments are required: SPEC (hint: see specc compile --help)")
    _one_line(capsys, ["plna"], "error: argument COMMAND: invalid choice: 'plna'")
    _one_line(capsys, ["hf", "export", "x", "--spec", GPT_TINY], "error: the following arguments are required: --out "
              "(hint: see specc hf export --help)")
    _one_line(capsys, ["plot", "run", "--nope"], "error: unrecognized arguments: --nope (hint: see specc plot --help)")
    _one_line(capsys, ["diff", GPT_TINY, GPT_TINY, "--b-flags=--tp x"], "error: argument --tp/--tensor-model-parallel-size: "
              "invalid int value: 'x' (hint: see specc plan --help)")  # flags parsed inside a command


def test_argument_errors_in_a_real_process():
    result = run("verify", "specs/gpt-tiny.yaml", "--steps", "two")
    assert result.returncode == 2 and result.stdout == ""
    assert result.stderr == ("error: argument --steps: invalid int value: 'two' (hint: see specc verify --help)\n")


def test_conflicting_duplicate_flags_are_reported(capsys):
    _one_line(capsys, ["plan", GPT_TINY, "--tp", "2", "--tensor-model-parallel-size", "4"],
              "error: argument --tp/--tensor-model-parallel-size: given twice with different values: --tp 2 and "
              "--tensor-model-parallel-size 4 (hint: see specc plan --help)")
    _one_line(capsys, ["plan", GPT_TINY, "--dtype", "fp32", "--dtype", "bf16"], "error: argument --dtype: given twice")
    _one_line(capsys, ["plan", GPT_TINY, "--set", "num_layers=3", "--set", "num_layers=4"],
              "--set num_layers=4: error: 'num_layers' is also set by --set num_layers=3, to another value")
    _one_line(capsys, ["plan", GPT_TINY, "--num-layers", "4", "--set", "num_layers=3"],
              "--num-layers 4: error: 'num_layers' is also set by --set num_layers=3, to another value")
    # the same value twice is no conflict
    assert main(["plan", GPT_TINY, "--tp", "2", "--tensor-model-parallel-size", "2", "--set", "num_layers=3",
                 "--num-layers", "3"]) == 0
    assert "layers.*.input_layernorm  x3" in capsys.readouterr().out


def test_sequence_parallel_at_tp1_is_reported(capsys):
    _one_line(capsys, ["plan", GPT_TINY, "--sp"], "--sequence-parallel: error: needs --tensor-model-parallel-size 2 "
              "or more")
    _one_line(capsys, ["compile", GPT_TINY, "--sequence-parallel", "--tp", "1", "-o", "/nonexistent/x"],
              "--sequence-parallel: error: needs")


@pytest.mark.parametrize("argv,starts", [
    (["--swiglu"], "error: --swiglu is a Megatron architecture flag"),
    (["--num-query-groups", "8"], "error: --num-query-groups 8: "),
    (["--normalization=RMSNorm"], "error: --normalization RMSNorm is a Megatron architecture flag"),
    (["--untie-embeddings-and-output-weights"], "error: --untie-embeddings-and-output-weights is a Megatron "
     "architecture flag"),
])
def test_megatron_architecture_flags_name_the_shipped_spec(capsys, argv, starts, names_bases_that_declare_it):
    err = _one_line(capsys, ["plan", GPT_TINY, *argv], starts)
    hint = err.split(" (hint: ", 1)[1]
    assert "specs/gpt" not in hint and ": specc plan specs/" in hint
    names_bases_that_declare_it(hint)


def test_graph_output_that_is_a_folder(capsys, tmp_path):
    _one_line(capsys, ["graph", GPT_TINY, "-o", tmp_path], f"{tmp_path}: error: is a folder, not a file")
    assert os.listdir(tmp_path) == []


def test_spec_name_too_long_for_a_file_name(capsys, tmp_path):
    from specc.frontend.load import MAX_NAME

    spec = tmp_path / "long.yaml"
    spec.write_text(f"name: {'n' * (MAX_NAME + 1)}\nextends: {GPT_TINY}\n")
    _one_line(capsys, ["validate", spec], f"{spec}:1:7: error: spec name is {MAX_NAME + 1} characters long, at most "
              f"{MAX_NAME}")
    spec.write_text(f"name: {'n' * MAX_NAME}\nextends: {GPT_TINY}\n")
    assert main(["validate", str(spec)]) == 0
    capsys.readouterr()
    _one_line(capsys, ["compile", GPT_TINY, "-o", tmp_path, "--name", "n" * (MAX_NAME + 1)],
              f"--name: error: the name is {MAX_NAME + 1} characters long, at most {MAX_NAME}")


@pytest.mark.parametrize("model,starts", [
    ("def broken(:\n", "model.py:1:12: error: not a Python module: invalid syntax"),
    (b"\xff\xfe\x00", "model.py: error: cannot read it as Python source ("),
    # what a generated module records is not a compile of this project's (the words may vary with
    # how a module records its settings: the one-line shape and the hint do not)
    ('COMPILE_COMMAND = "rm -rf /"\n', "model.py: error: "),
    ('COMPILE_COMMAND = "specc plan x.yaml"\n', "model.py: error: "),
    ('COMPILE_COMMAND = "specc compile x.yaml --bogus"\n', "model.py: error: "),
    ('COMPILE_COMMAND = "specc compile \'x.yaml"\n', "model.py: error: "),
], ids=["syntax", "binary", "not-specc", "not-compile", "bad-flag", "bad-quoting"])
def test_check_of_a_broken_generated_folder(capsys, tmp_path, model, starts):
    folder = tmp_path / "generated" / "m"
    folder.mkdir(parents=True)
    path = folder / "model.py"
    path.write_bytes(model if isinstance(model, bytes) else model.encode())
    err = _one_line(capsys, ["check", tmp_path / "generated"], f"{path}{starts[len('model.py'):]}")
    assert err.endswith("(recompile it with `specc compile`)")


def test_expert_parallelism_on_a_spec_without_experts_is_one_line():
    r = run("plan", "specs/gpt-tiny.yaml", "--ep", "2")
    assert r.returncode == 2 and r.stdout == ""
    assert r.stderr.strip() == ("--expert-model-parallel-size 2: error: this spec has no expert weights to split over "
                                "expert-parallel ranks (drop --expert-model-parallel-size, or use a mixture-of-experts "
                                "spec (docs/moe.md))")
    assert run("plan", "specs/mixtral-tiny.yaml", "--ep", "2").returncode == 0

