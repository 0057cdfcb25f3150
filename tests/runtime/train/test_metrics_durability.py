"""metrics.jsonl survives a crash: everything up to a checkpoint is on disk before the checkpoint
is saved, a run resumed from that checkpoint drops what was recorded after it (and a line the
crash cut in half), so every iteration appears exactly once; NaN and infinity are valid JSON."""

from __future__ import annotations

import io
import json
import math
import os
import shutil

import pytest

from runtime.train.report import METRICS, Reporter


def _reporter(run_dir, log_interval, append=False) -> Reporter:
    return Reporter(str(run_dir), train_iters=6, log_interval=log_interval, progress=False, stream=io.StringIO(),
                    append=append)


def _train(rep, iteration, loss=2.0, grad_norm=0.5):
    rep.train(iteration=iteration, consumed_samples=4 * iteration, lr=1e-3, loss=loss, grad_norm=grad_norm,
              step_time=0.01, tokens=128, batch_size=4, memory_mb=10.0, skipped=False)


def _strict_records(path) -> list:
    """Every line parsed as strict JSON (NaN, Infinity are not JSON)."""
    def refuse(constant):
        raise ValueError(f"{constant} is not JSON")

    with open(path, encoding="utf-8") as f:
        return [json.loads(line, parse_constant=refuse) for line in f]


def test_a_run_resumed_after_a_kill_records_every_iteration_once(tmp_path):
    run = tmp_path / "run"
    rep = _reporter(run, log_interval=4)
    _train(rep, 1)
    assert os.path.getsize(run / METRICS) == 0  # buffered: a kill now would lose it
    _train(rep, 2)
    rep.evaluation(iteration=2, loss=2.5)
    rep.sync()  # the checkpoint of iteration 2 is saved now
    assert [r["iteration"] for r in _strict_records(run / METRICS)] == [1, 2, 2]
    _train(rep, 3)
    _train(rep, 4)  # a log interval: flushed
    rep.evaluation(iteration=4, loss=2.4)
    _train(rep, 5)  # buffered

    # kill -9 here: only what reached the file is left, and the last write was cut short
    crashed = tmp_path / "crashed"
    crashed.mkdir()
    shutil.copyfile(run / METRICS, crashed / METRICS)
    with open(crashed / METRICS, "a") as f:
        f.write('{"kind": "train", "iteration": 5, "consumed_s')
    rep.close()
    assert [r["iteration"] for r in _strict_records(run / METRICS)] == [1, 2, 2, 3, 4, 4, 5]  # closed: all there

    # the restart resumes from the checkpoint of iteration 2 and runs 3..6 again
    again = _reporter(crashed, log_interval=4, append=True)
    again.resume(2)
    for iteration in (3, 4, 5, 6):
        _train(again, iteration, loss=1.0)
    again.close()
    records = _strict_records(crashed / METRICS)
    assert [(r["kind"], r["iteration"]) for r in records] == [
        ("train", 1), ("train", 2), ("eval", 2), ("train", 3), ("train", 4), ("train", 5), ("train", 6)]
    assert [r["loss"] for r in records if r["kind"] == "train"] == [2.0, 2.0, 1.0, 1.0, 1.0, 1.0]


def test_starting_over_after_a_restart_keeps_nothing_of_the_first_attempt(tmp_path):
    rep = _reporter(tmp_path, log_interval=1)
    _train(rep, 1)
    rep.close()
    again = _reporter(tmp_path, log_interval=1, append=True)
    again.resume(0)  # no checkpoint to resume from
    _train(again, 1, loss=3.0)
    again.close()
    assert [(r["iteration"], r["loss"]) for r in _strict_records(tmp_path / METRICS)] == [(1, 3.0)]


def test_nan_and_infinity_are_written_as_null(tmp_path):
    rep = _reporter(tmp_path, log_interval=1)
    _train(rep, 1, loss=float("nan"), grad_norm=float("inf"))
    _train(rep, 2, loss=2.0, grad_norm=-float("inf"))
    rep.evaluation(iteration=2, loss=float("nan"))
    rep.close()
    first, second, ev = _strict_records(tmp_path / METRICS)
    assert first["loss"] is None and first["grad_norm"] is None and first["lr"] == 1e-3
    assert second["loss"] == 2.0 and second["grad_norm"] is None
    assert ev["kind"] == "eval" and ev["loss"] is None and ev["ppl"] is None
    assert math.isclose(first["tokens_per_s"], 128 / 0.01)

    # `specc plot` reads them as NaN (gaps in the curve), not as an error
    pytest.importorskip("matplotlib")
    from specc_cli.plot import plot_run, read_metrics

    train, evals = read_metrics(str(tmp_path))
    assert math.isnan(train[0]["loss"]) and math.isnan(evals[0]["loss"]) and math.isnan(evals[0]["ppl"])
    assert os.path.getsize(plot_run(str(tmp_path), str(tmp_path / "loss.png"))) > 0
