"""The launcher refuses a run the node cannot hold, in one line, before any rank starts: the
plan's memory per rank (on the pipeline rank that needs the most) against the host's."""

from __future__ import annotations

import os
import subprocess
import sys

import specc_torch.memory_check as memory_check
from runtime.train.config import ParallelConfig, TrainConfig, resolve
from specc_torch.train_compile import compile_run

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
    done = subprocess.run([sys.executable, "-m", "specc_cli", "train", GPT_TINY, "--hidden-size", "100000",
                           "--nproc-per-node", "2", "--device", "cpu", "--run-dir", str(run_dir), "--mock-data"],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 2, done.stderr
    (line,) = done.stderr.splitlines()
    assert line.startswith("error: the model does not fit: the plan needs at least ")
    assert "parameters 894.19 GiB" in line and " x 2 ranks on this node, this host has " in line
    assert not run_dir.exists()


def test_each_pipeline_rank_and_expert_shard_plans_its_own_share():
    cfg, totals = _totals(world=2, pp=2)
    ranks = totals["pipeline"]["ranks"]
    shares = [memory_check.rank_need(totals, cfg, r, in_flight=False) for r in range(2)]
    assert [s["parameters"] // 4 for s in shares] == [r["parameters"] for r in ranks]
    whole = memory_check.rank_need(_totals()[1], _totals()[0])
    assert shares[0]["activations"] + shares[1]["activations"] == whole["activations"]  # one micro-batch each
    # experts: their Adam state over DP / EP ranks, the dense weights' over DP
    cfg = TrainConfig(spec=os.path.join(ROOT, "specs", "mixtral-tiny.yaml"), parallel=ParallelConfig(ep=2),
                      micro_batch_size=1, global_batch_size=4)
    assert resolve(cfg, 4) == []  # DP 4, EP 2: experts data-parallel over 2 ranks
    cfg.optimizer.use_distributed_optimizer = True
    totals = compile_run(cfg)[2].totals
    experts = totals["expert_parameters"]
    dense = totals["parameters"] - experts
    per_param = totals["optimizer_bytes"] // totals["parameters"]
    assert 0 < experts < totals["parameters"]
    want = per_param * dense / 4 + per_param * experts / 2
    assert abs(memory_check.rank_need(totals, cfg)["optimizer"] - want) <= 1
