"""`specc diff` and `specc plot` read JSON a user hands them: nested deeper than the parser
recurses, or holding an integer of more digits than int() converts, each is one line and exit 2,
not a RecursionError or ValueError traceback."""

from __future__ import annotations

import pytest

DEEP = "[" * 100_000 + "]" * 100_000
HUGE = "9" * 100_000


@pytest.mark.parametrize("text,why", [(DEEP, "nested too deeply"),
                                      ('{"ops": ' + HUGE + ', "totals": {}}',
                                       "Exceeds the limit (4300 digits) for integer string conversion")])
def test_diff_of_a_hostile_plan_json_is_one_line(specc, tmp_path, text, why):
    path = tmp_path / "plan.json"
    path.write_text(text)
    code, out, err = specc("diff", path, path)
    assert (code, out, err) == (2, "", f"{path}: error: not a plan.json ({why})\n")


@pytest.mark.parametrize("text,why", [(DEEP, "nested too deeply"),
                                      ('{"kind": "train", "iteration": ' + HUGE + "}",
                                       "Exceeds the limit (4300 digits) for integer string conversion")])
def test_plot_of_hostile_metrics_is_one_line(specc, tmp_path, text, why):
    (tmp_path / "metrics.jsonl").write_text('{"kind": "train", "iteration": 1, "loss": 5.0}\n' + text + "\n")
    code, out, err = specc("plot", tmp_path)
    assert (code, out) == (2, "")
    assert err == f"error: {tmp_path}/metrics.jsonl:2: not a metrics record ({why})\n"
    assert not (tmp_path / "loss.png").exists()


def test_diff_of_a_fifo_named_json_is_one_line_not_a_hang(specc, tmp_path):
    import os

    fifo = tmp_path / "plan.json"
    os.mkfifo(fifo)
    code, out, err = specc("diff", fifo, fifo)
    assert (code, out, err) == (2, "", f"{fifo}: error: not a regular file (a plan.json is one)\n")
