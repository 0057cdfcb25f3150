"""Issue 12's pipeline acceptance from the command line: the seed's `specc train` command with
--pipeline-model-parallel-size 2 added trains the tiny GPT (tied embeddings; 4 layers here, so
that PP=4 can load it) on 4 gloo ranks (TP=2 + SP inside each of 2 stages); its checkpoint,
with the optimizer state, resumes at PP=1 and at PP=4 to the very step PP=2 took next; then the
PP flags' errors, one line each, before any rank starts. PP=2 is launched through torchrun; PP=4's
ranks are the session's gloo pool (tests/specc_cli/gloo_launch.py: the command line, launch's
checks and the ranks' entry as `specc train` runs them, without a second torchrun launch's
process starts)."""

from __future__ import annotations

import json
import os

import pytest

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
GPT_TINY = os.path.join(ROOT, "specs", "gpt-tiny.yaml")
# the seed's command (docs/training.md), at a test's size: micro-batch 16, global batch 32
SEED = ("--nproc-per-node", "4", "--tensor-model-parallel-size", "2", "--sequence-parallel",
        "--micro-batch-size", "16", "--global-batch-size", "32", "--lr", "3e-3")
SMALL = ("--eval-iters", "1", "--log-interval", "1", "--no-progress")


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    from runtime.data import prepare, stdlib_files

    out = str(tmp_path_factory.mktemp("pp_cli") / "corpus")
    prepare(stdlib_files(limit=20), "byte", out)  # 20 documents: one for validation
    return out


def _records(run_dir, kind) -> list:
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [r for r in map(json.loads, f) if r["kind"] == kind]


def test_pp2_tp2_trains_and_its_checkpoint_resumes_at_pp1_and_pp4(specc, corpus, tmp_path, monkeypatch,
                                                                  ranks_on_gloo):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    ckpt = tmp_path / "ckpt"
    layers = ("--num-layers", "4")
    code, out, err = specc("train", GPT_TINY, *SEED, *layers, "--pipeline-model-parallel-size", "2",
                           "--train-iters", "4", "--save", ckpt, "--save-interval", "3", "--data-path", corpus,
                           "--run-dir", tmp_path / "pp2", *SMALL)
    assert code == 0, out + err[-3000:]
    assert "TP 2 x CP 1 x DP 1 x PP 2" in out and out.count("consumed samples:") == 4
    trained = _records(tmp_path / "pp2", "train")
    assert [r["iteration"] for r in trained] == [1, 2, 3, 4] and trained[-1]["loss"] < trained[0]["loss"]
    (evaluated,) = _records(tmp_path / "pp2", "eval")
    step3 = ckpt / "step_0000003"

    # Resume from step 3 at PP=1 (one process) and at PP=4 (4 ranks): weights, Adam moments and
    # the data position come back, so step 4 is PP=2's step 4 (loss before it, validation after it).
    launched = ranks_on_gloo()
    runs = {"pp1": ("--micro-batch-size", "16", "--global-batch-size", "32", "--lr", "3e-3"),
            "pp4": ("--nproc-per-node", "4", "--pipeline-model-parallel-size", "4", "--micro-batch-size", "8",
                    "--global-batch-size", "32", "--lr", "3e-3")}
    for name, flags in runs.items():
        code, out, err = specc("train", GPT_TINY, *flags, *layers, "--load", step3, "--train-iters", "4",
                               "--data-path", corpus, "--run-dir", tmp_path / name, *SMALL)
        assert code == 0, out + err[-3000:]
        assert len(launched) == (name == "pp4")  # PP=1: one rank, trained in this process
        (line,) = [ln for ln in out.splitlines() if ln.startswith(f"loaded checkpoint {step3} at iteration 3")]
        assert "'pp': 2" in line and line.endswith(", resharded)")
        (step4,) = _records(tmp_path / name, "train")
        (valid,) = _records(tmp_path / name, "eval")
        assert step4["iteration"] == valid["iteration"] == 4
        assert step4["loss"] == pytest.approx(trained[-1]["loss"], rel=1e-5), name
        # after one Adam step from the loaded moments (a fresh optimizer would step differently)
        assert valid["loss"] == pytest.approx(evaluated["loss"], rel=1e-4), name


def test_the_pipeline_flags_and_their_errors(specc, corpus, tmp_path):
    run_dir = tmp_path / "never"
    cases = [
        (("--pipeline-model-parallel-size", "2", "--nproc-per-node", "2", "--global-batch-size", "1"),
         "error: --global-batch-size 1 gives 1 micro-batch(es) per step, fewer than the 2 pipeline stages the 1F1B "
         "schedules keep in flight (use --global-batch-size 2 or more)\n"),
        (("--decoder-first-pipeline-num-layers", "1"),
         "--decoder-first-pipeline-num-layers: error: has no effect without pipeline parallelism (add "
         "--pipeline-model-parallel-size N (N > 1), or drop it)\n"),
        (("--pipeline-model-parallel-size", "4", "--nproc-per-node", "4", "--global-batch-size", "4"),
         "--pipeline-model-parallel-size: error: 2 layers cannot be cut into 4 pipeline stages of at least one layer "
         "each (use fewer stages)\n"),
        (("--pipeline-schedule", "gpipe"),
         "error: --pipeline-schedule has no effect without pipeline parallelism (add --pipeline-model-parallel-size "
         "N, or drop it)\n"),
    ]
    for flags, expected in cases:
        code, _, err = specc("train", GPT_TINY, *flags, "--data-path", corpus, "--run-dir", run_dir)
        assert (code, err) == (2, expected)
    assert not run_dir.exists()
