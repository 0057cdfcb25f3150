"""`specc plot` on a synthetic metrics.jsonl: a panel per recorded metric, deterministic bytes."""

from __future__ import annotations

import json

import pytest

from specc_cli.main import main
from specc_cli.plot import panels_of, read_metrics

pytest.importorskip("matplotlib")


def _write(run_dir, keys=("lr", "grad_norm", "tflops_per_rank", "mfu", "memory_mb")):
    lines = []
    for i in range(1, 21):
        record = {"kind": "train", "iteration": i, "loss": 5.0 - 0.1 * i, "tokens_per_s": 1000.0 + i,
                  "lr": 1e-3 * min(1.0, i / 5), "grad_norm": 2.0 / i, "tflops_per_rank": 10.0 + i,
                  "mfu": 0.1, "memory_mb": 512.0}
        lines.append(json.dumps({k: v for k, v in record.items() if k not in ("lr", "grad_norm", "tflops_per_rank",
                                                                              "mfu", "memory_mb") or k in keys}))
    lines.append(json.dumps({"kind": "eval", "iteration": 20, "loss": 3.2}))
    (run_dir / "metrics.jsonl").write_text("\n".join(lines) + "\n")


def test_every_recorded_metric_gets_a_panel(tmp_path):
    _write(tmp_path)
    train, _ = read_metrics(str(tmp_path))
    assert [p[0] for p in panels_of(train)] == ["tokens_per_s", "lr", "grad_norm", "tflops_per_rank", "mfu",
                                                "memory_mb"]


def test_absent_or_null_metrics_are_skipped(tmp_path):
    _write(tmp_path, keys=("lr",))
    text = (tmp_path / "metrics.jsonl").read_text().replace('"tokens_per_s": ', '"tokens_per_s": null, "x": ')
    (tmp_path / "metrics.jsonl").write_text(text)
    train, _ = read_metrics(str(tmp_path))
    assert [p[0] for p in panels_of(train)] == ["lr"]
    assert main(["plot", str(tmp_path)]) == 0
    assert (tmp_path / "loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_png_is_deterministic_and_complete(tmp_path):
    _write(tmp_path)
    assert main(["plot", str(tmp_path), "-o", str(tmp_path / "a.png")]) == 0
    assert main(["plot", str(tmp_path), "-o", str(tmp_path / "b.png")]) == 0
    assert (tmp_path / "a.png").read_bytes() == (tmp_path / "b.png").read_bytes()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.png", "b.png", "metrics.jsonl"]  # no .tmp left


def test_unwritable_output_is_one_line(tmp_path, capsys):
    _write(tmp_path)
    assert main(["plot", str(tmp_path), "-o", str(tmp_path / "no" / "x.png")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error:")
