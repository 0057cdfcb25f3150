"""The launcher refuses a run the node cannot hold, in one line, before any rank starts: the
plan's memory per rank (on the pipeline rank that needs the most) against the host's."""

from __future__ import annotations

import os
import subprocess
import sys

import specc_torch.memory_check as memory_check
from runtime.train.config import ParallelConfig, TrainConfig, resolve
from specc_torch.train import compile_run

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
GPT_TINY = os.path.join(ROOT, "specs", "gpt-tiny.yaml")


def _totals(world=1, **parallel):
    cfg = TrainConfig(spec=GPT_TINY, parallel=ParallelConfig(**parallel), micro_batch_size=2,
                      global_batch_size=8, overrides={"num_layers": 4})
    assert resolve(cfg, world) == []
    return cfg, compile_run(cfg)[2].totals


def test_the_need_is_the_pipeline_rank_that_holds_the_most():
    cfg, totals = _totals()
    whole = memory_check.rank_need(totals, cfg)
    assert whole["parameters"] == totals["parameter_bytes"] and whole["gradients"] == totals["gradient_bytes"]
    assert whole["optimizer"] == totals["optimizer_bytes"] and whole["activations"] == totals["activation_bytes"]
    cfg2, totals2 = _totals(world=2, pp=2)
    staged = memory_check.rank_need(totals2, cfg2)
    ranks = totals2["pipeline"]["ranks"]
    assert len(ranks) == 2
    busiest = max(ranks, key=lambda r: r["parameters"] * (4 + 4 + 8) + r["peak_activation_bytes"])
    assert staged["parameters"] == busiest["parameters"] * 4 < whole["parameters"]
    assert staged["activations"] == busiest["peak_activation_bytes"]
    # the distributed optimizer shards Adam's state over DP
    cfg3, totals3 = _totals(world=2)
    cfg3.optimizer.use_distributed_optimizer = True
    assert memory_check.rank_need(totals3, cfg3)["optimizer"] == totals3["optimizer_bytes"] // 2


def test_ranks_on_one_host_share_its_memory(monkeypatch):
    cfg, totals = _totals()
    need = sum(memory_check.rank_need(totals, cfg).values())
    monkeypatch.setattr(memory_check, "host_available", lambda: 3 * need)
    assert memory_check.memory_rules(totals, cfg, 3, "cpu") == []
    (line,) = memory_check.memory_rules(totals, cfg, 4, "cpu")
    assert line.startswith("the model does not fit: the plan needs at least ") and " x 4 ranks on this node" in line
    monkeypatch.setattr(memory_check, "host_available", lambda: None)  # unknown: never refused on a guess
    assert memory_check.memory_rules(totals, cfg, 64, "cpu") == []


def test_a_model_too_large_for_the_host_is_one_line_before_anything_starts(tmp_path):
    run_dir = tmp_path / "never"
    done = subprocess.run([sys.executable, "-m", "specc", "train", GPT_TINY, "--hidden-size", "100000",
                           "--nproc-per-node", "2", "--device", "cpu", "--run-dir", str(run_dir), "--mock-data"],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 2, done.stderr
    (line,) = done.stderr.splitlines()
    assert line.startswith("error: the model does not fit: the plan needs at least ")
    assert "parameters 894.19 GiB" in line and " x 2 ranks on this node, this host has " in line
    assert not run_dir.exists()
