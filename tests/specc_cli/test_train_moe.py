"""Issue 14's acceptance: `specc train` of the tiny Mixtral at EP=2 x DP=4 (4 gloo ranks: two
expert-parallel groups of 2, the experts' gradients reduced over their expert-data-parallel
group, the distributed optimizer) trains, logs the load-balancing loss beside the LM loss, and its
checkpoint loads at EP=1 in one process with the same validation loss. The 4 ranks are the
session's gloo pool (tests/specc_cli/gloo_launch.py: the command line, launch's checks and the
ranks' entry as `specc train` runs them, without torchrun's process starts)."""

from __future__ import annotations

import json
import os

import pytest

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
MIXTRAL_TINY = os.path.join(ROOT, "specs", "mixtral-tiny.yaml")
SMALL = ("--micro-batch-size", "2", "--global-batch-size", "8", "--eval-iters", "2", "--log-interval", "1",
         "--no-progress")


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    from runtime.data import prepare, stdlib_files

    out = str(tmp_path_factory.mktemp("moe_cli") / "corpus")
    prepare(stdlib_files(limit=20), "byte", out)
    return out


def _records(run_dir, kind) -> list:
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [r for r in map(json.loads, f) if r["kind"] == kind]


def test_ep2_trains_and_its_checkpoint_loads_at_ep1_with_the_same_validation_loss(specc, corpus, tmp_path,
                                                                                   ranks_on_gloo):
    launched = ranks_on_gloo()
    ckpt = tmp_path / "ckpt"
    code, out, err = specc("train", MIXTRAL_TINY, "--nproc-per-node", "4", "--expert-model-parallel-size", "2",
                           "--use-distributed-optimizer", "--train-iters", "4", "--lr", "3e-3", "--save", ckpt,
                           "--data-path", corpus, "--run-dir", tmp_path / "ep", *SMALL)
    assert code == 0, out + err[-3000:]
    assert len(launched) == 1 and "launching 4 ranks: torchrun --nproc-per-node 4 --nnodes 1 -m specc_torch.train" in err
    assert "TP 1 x CP 1 x DP 4 x PP 1" in out and out.count("load balancing loss: ") == 4
    trained = _records(tmp_path / "ep", "train")
    assert [r["iteration"] for r in trained] == [1, 2, 3, 4] and trained[-1]["loss"] < trained[0]["loss"]
    assert all(0 < r["load_balancing_loss"] < 1 for r in trained)
    (saved,) = _records(tmp_path / "ep", "eval")

    code, out, err = specc("train", MIXTRAL_TINY, "--load", ckpt, "--train-iters", "4", "--data-path", corpus,
                           "--run-dir", tmp_path / "one", *SMALL)
    assert code == 0, out + err
    assert len(launched) == 1  # one rank: trained in this process
    (line,) = [ln for ln in out.splitlines() if ln.startswith(f"loaded checkpoint {ckpt / 'step_0000004'} at iteration 4")]
    assert "'ep': 2" in line and line.endswith(", resharded)")
    (loaded,) = _records(tmp_path / "one", "eval")
    assert loaded["loss"] == pytest.approx(saved["loss"], rel=1e-5)


def test_expert_parallel_flags_and_their_errors(specc, corpus, tmp_path):
    run_dir = tmp_path / "never"
    code, _, err = specc("train", MIXTRAL_TINY, "--nproc-per-node", "2", "--expert-model-parallel-size", "4",
                         "--data-path", corpus, "--run-dir", run_dir)
    assert code == 2 and len(err.strip().splitlines()) == 1 and "must divide the data-parallel size 2" in err
    code, _, err = specc("train", MIXTRAL_TINY, "--expert-tensor-parallel-size", "2", "--data-path", corpus,
                         "--run-dir", run_dir)
    assert code == 2 and len(err.strip().splitlines()) == 1 and "--expert-tensor-parallel-size 2 differs" in err
    code, _, err = specc("compile", MIXTRAL_TINY, "--ep", "3", "-o", tmp_path / "gen")
    assert code == 2 and "num_experts=8 is not divisible by expert-model-parallel size 3" in err
    assert not run_dir.exists() and not (tmp_path / "gen").exists()
