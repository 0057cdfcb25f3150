"""`specc validate` end to end: every shipped spec passes, errors are one line with exit 2, and
validating starts fast without importing torch."""

from __future__ import annotations

import contextlib
import io
import json
import os
import subprocess
import sys
import time

from specc_cli.main import main

from .conftest import ROOT

SHIPPED = sorted(f"specs/{name}" for name in os.listdir(ROOT / "specs") if name.endswith(".yaml"))


def run(*argv) -> tuple:
    out, err = io.StringIO(), io.StringIO()
    cwd = os.getcwd()
    os.chdir(ROOT)
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            code = main(list(argv))
    finally:
        os.chdir(cwd)
    return code, out.getvalue(), err.getvalue()


def test_every_shipped_spec_validates():
    assert len(SHIPPED) >= 6
    for flags in ([], ["--tp", "2"], ["--tp", "4", "--sp"]):
        code, out, err = run("validate", *SHIPPED, *flags)
        assert (code, err) == (0, ""), err
        lines = out.splitlines()
        assert [ln.split(": ok: ")[0] for ln in lines] == SHIPPED


def test_megatron_flags_and_set_override_the_config():
    code, out, _ = run("validate", "specs/gpt-tiny.yaml", "--num-layers", "3", "--set", "hidden_size=128")
    assert code == 0 and "3 layers, hidden 128" in out


def test_good_and_bad_specs_together(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: bad\nmodels: {}\n")
    code, out, err = run("validate", "specs/gpt-tiny.yaml", str(bad), "specs/llama-tiny.yaml")
    assert code == 2
    assert len(out.splitlines()) == 2
    assert err == f"{bad}:2:1: error: unknown key 'models' at the top level of the spec (did you mean 'model'?)\n"


def test_command_line_errors_name_the_flag():
    code, _, err = run("validate", "specs/gpt-tiny.yaml", "--set", "nothing")
    assert (code, err) == (2, "--set nothing: error: expected KEY=VALUE (e.g. --set hidden_size=2048)\n")


def test_schema_is_json_and_names_every_op():
    from specc.ops import SPEC_OPS

    code, out, _ = run("schema")
    schema = json.loads(out)
    assert code == 0 and schema["required"] == ["name", "model", "modules"]
    assert {f"op_{name}" for name in SPEC_OPS} <= set(schema["$defs"])


def test_validate_imports_no_torch_and_is_fast():
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, "-X", "importtime", "-m", "specc_cli", "validate", "specs/gpt.yaml"],
                          cwd=ROOT, capture_output=True, text=True, timeout=60)
    seconds = time.perf_counter() - start
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("specs/gpt.yaml: ok: gpt:")
    imported = [ln for ln in proc.stderr.splitlines() if ln.startswith("import time:")]
    assert imported, "no -X importtime output"
    assert not [ln for ln in imported if "torch" in ln]
    assert seconds < 2.0
