"""`specc diff`: what changed between two plans, exit 1 when they differ."""

from __future__ import annotations

import os

from specc.cli import main

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", ".."))
GPT = os.path.join(ROOT, "specs", "gpt-tiny.yaml")


def test_same_plan_is_identical(capsys):
    assert main(["diff", GPT, GPT]) == 0
    assert "plans are identical" in capsys.readouterr().out


def test_sequence_parallel_change_is_reported(capsys):
    assert main(["diff", GPT, GPT, "--a-flags", "--tp 2", "--b-flags", "--tp 2 --sp"]) == 1
    out = capsys.readouterr().out
    assert "settings: sp False -> True" in out
    assert "+ layers.*.self_attention.out:P->S(s)" in out or "P->S(s)" in out
    assert "reduce_scatter: 0 x 0 B ->" in out
    assert "activations:" in out


def test_saved_plan_against_a_spec(tmp_path, capsys):
    saved = tmp_path / "plan.json"
    assert main(["plan", GPT, "--tp", "2", "--json"]) == 0
    saved.write_text(capsys.readouterr().out)
    assert main(["diff", str(saved), GPT, "--b-flags", "--tp 2"]) == 0
    assert main(["diff", str(saved), GPT, "--b-flags", "--tp 4"]) == 1


def test_bad_sides_are_one_line_errors(tmp_path, capsys):
    bad = tmp_path / "x.json"
    bad.write_text("{not json")
    assert main(["diff", str(bad), GPT]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"{bad}:1:2: error: not a plan.json")
    assert main(["diff", str(tmp_path / "missing.json"), GPT]) == 2
    assert "no such file" in capsys.readouterr().err
