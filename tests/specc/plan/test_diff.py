"""`specc diff`: what changed between two plans, exit 1 when they differ."""

from __future__ import annotations

import os

from specc_cli.main import main

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


def test_changed_lines_name_the_field_and_differ(capsys):
    assert main(["diff", GPT, GPT, "--a-flags", "--tp 1", "--b-flags", "--tp 2 --sp"]) == 1
    out = capsys.readouterr().out
    changed = [ln for ln in out.splitlines() if ln.startswith("  ~ ")]
    assert changed
    for ln in changed:  # `~ NAME: FIELD BEFORE -> AFTER`, before and after never the same
        field_and_values = ln.split(": ", 1)[1]
        before, after = field_and_values.split(" ", 1)[1].split(" -> ")
        assert before != after, ln
    assert "~ embedding: weights weight [256x64] -> weight [128x64]" in out
    assert any(": saved " in ln for ln in changed)
    assert any(": notes " in ln for ln in changed)
    assert "grad sync all_reduce: 0 x 0 B -> 1 x" in out


def test_a_lone_flag_value_is_taken(capsys):
    """`--b-flags '--sp'` (one flag, as the README writes it) is side B's flags, not an option of diff."""
    assert main(["diff", GPT, GPT, "--a-flags", "--tp 2", "--b-flags", "--tp 2 --sp"]) == 1
    first = capsys.readouterr().out
    assert main(["diff", GPT, GPT, "--a-flags=--tp 2", "--b-flags=--tp 2 --sp"]) == 1
    assert capsys.readouterr().out == first  # deterministic, either spelling
    assert main(["diff", GPT, GPT, "--a-flags", "--sp"]) == 2  # parsed as flags: --sp needs --tp
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "needs --tensor-model-parallel-size" in err[0]
