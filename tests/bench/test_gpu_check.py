"""The prepared GPU check's logic, on the CPU: which checks run on which machine, the comparison
and MFU arithmetic, the time budget, the report's place in docs/benchmarks.md, and the whole
script end to end with `--device cpu` at tiny sizes (what a GPU session runs, minus the GPU)."""

from __future__ import annotations

import json
import os

import pytest
import torch
from bench_modules import load

gpu_check = load("gpu_check")
Machine = gpu_check.Machine


def test_which_checks_run_follows_the_machine():
    one = dict(gpu_check.plan_checks(Machine("cuda", 1, "H200", te=False, flash=False)))
    assert one["cuda_vs_cpu"] is None and one["bench_124m"] is None
    assert "neither" in one["backends"] and "needs 2 GPUs" in one["nccl_verify"]
    two = dict(gpu_check.plan_checks(Machine("cuda", 2, "H200", te=True, flash=False)))
    assert all(reason is None for reason in two.values())
    cpu = dict(gpu_check.plan_checks(Machine("cpu", 0, "CPU", te=True, flash=True)))
    assert cpu["backends"] == "needs CUDA" and cpu["nccl_verify"] is not None
    with pytest.raises(SystemExit, match="no CUDA device"):
        gpu_check.plan_checks(Machine("cuda", 0, "CPU", te=False, flash=False))


def test_compare_is_relative_to_the_largest_value():
    ref = torch.tensor([1000.0, 1e-3])
    assert gpu_check.compare(ref, ref + torch.tensor([0.05, 0.05]), 1e-4)[0]  # 5e-5 of the scale
    ok, diff, scale = gpu_check.compare(ref, ref + torch.tensor([0.0, 0.2]), 1e-4)
    assert not ok and diff == pytest.approx(0.2) and scale == 1000.0


def test_mfu_arithmetic():
    assert gpu_check.mfu(50e12, 1.0, 100.0) == pytest.approx(0.5)
    assert gpu_check.mfu(1.0, 0.0, 100.0) == 0.0


def test_the_report_replaces_only_its_own_section(tmp_path):
    doc = tmp_path / "benchmarks.md"
    doc.write_text("# Benchmarks\n\n## Training step\n\nA\n\n## GPU check\n\nold\n\n## Context parallelism\n\nC\n")
    gpu_check.write_section(str(doc), "## GPU check\n\nnew\n")
    text = doc.read_text()
    assert "old" not in text and "new" in text
    assert text.index("## Training step") < text.index("## GPU check") < text.index("## Context parallelism")
    doc2 = tmp_path / "other.md"
    doc2.write_text("# Benchmarks\n\n## Training step\n\nA\n")
    gpu_check.write_section(str(doc2), "## GPU check\n\nnew\n")
    assert doc2.read_text().endswith("## GPU check\n\nnew\n") and "A" in doc2.read_text()


def test_a_spent_budget_skips_every_check(tmp_path, capsys):
    out = tmp_path / "r.json"
    rc = gpu_check.main(["--device", "cpu", "--budget-s", "0", "--no-write", "--json", str(out)])
    results = json.loads(out.read_text())["results"]
    assert rc == 0 and [r["status"] for r in results] == ["skipped"] * 4
    assert all("budget" in r["detail"] or "CUDA" in r["detail"] or "GPU" in r["detail"] for r in results)


def test_the_whole_check_runs_on_the_cpu(tmp_path):
    out, doc = tmp_path / "r.json", tmp_path / "benchmarks.md"
    rc = gpu_check.main(["--device", "cpu", "--bench-spec", "specs/gpt-tiny.yaml", "--micro-batch", "2", "--steps", "1",
                         "--gemm-n", "64", "--output", str(doc), "--json", str(out)])
    results = {r["check"]: r for r in json.loads(out.read_text())["results"]}
    assert rc == 0, results
    assert results["cuda_vs_cpu"]["status"] == "pass" and "gpt-tiny.yaml" in results["cuda_vs_cpu"]["detail"]
    assert results["backends"]["status"] == "skipped" and results["nccl_verify"]["status"] == "skipped"
    bench = results["bench_124m"]
    assert bench["status"] == "pass"
    numbers = bench["numbers"]
    assert numbers["step_ms"] > 0 and 0 < numbers["mfu"] and numbers["gemm_peak_tflops"] > 0
    assert numbers["plan_bytes"] > 0 and numbers["measured_bytes"] is None  # measured on CUDA only
    assert "## GPU check" in doc.read_text() and "bench_124m | pass" in doc.read_text()


def test_the_multi_rank_check_compares_the_tp2_losses_with_tp1(monkeypatch):
    """On a GPU it runs `specc train` twice (TP=1, TP=2+SP over NCCL); run by hand on gloo it gave
    identical losses. Here the comparison itself: equal passes, a 1e-3 drift fails."""
    runs = {}

    def fake(run_dir, device, nproc, extra, timeout_s):
        runs[os.path.basename(run_dir)] = (nproc, extra)
        return [5.5, 5.4, 5.3] if nproc == 1 else losses

    monkeypatch.setattr(gpu_check, "_train_losses", fake)
    losses = [5.5, 5.4, 5.3 * (1 + 1e-6)]
    assert gpu_check.check_multi_rank("cuda", 2, 60).status == "pass"
    assert runs["tp2"] == (2, ["--tensor-model-parallel-size", "2", "--sequence-parallel"]) and runs["tp1"][0] == 1
    losses = [5.5, 5.4 * (1 + 1e-3), 5.3]
    assert gpu_check.check_multi_rank("cuda", 2, 60).status == "fail"
