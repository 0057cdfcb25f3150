"""What a run lets you watch: the run directory holds the model.py, plan.txt and plan.json that
trained and the model is imported from that model.py (a traceback inside it shows its lines);
the log's first line names the peak, every log line carries TFLOP/s and MFU from the plan's FLOP
count, the start prints the plan's memory next to what the first step measured; Weights & Biases
is imported only when a project is given, and missing it is a one-line error."""

from __future__ import annotations

import io
import json
import sys
import traceback

import pytest
import torch
from train_helpers import make_corpus, tiny_config

from runtime.parallel_state import ProcessGroups
from runtime.train.config import resolve
from specc_torch.train import run
from specc_torch.train_compile import compile_run

FAKE_WANDB = '''
import json, os
CALLS = []
class _Run:
    def log(self, values, step):
        CALLS.append(["log", step, values])
    def finish(self):
        CALLS.append(["finish"])
        with open(os.path.join(DIR, "wandb_calls.json"), "w") as f:
            json.dump(CALLS, f)
def init(project, name, dir, config):
    global DIR
    DIR = dir
    CALLS.append(["init", project, name, sorted(config)])
    return _Run()
'''


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return make_corpus(str(tmp_path_factory.mktemp("watch")))


def test_a_run_dir_holds_what_trained_and_every_line_shows_tflops_and_mfu(corpus, tmp_path, monkeypatch):
    fake = tmp_path / "site"
    fake.mkdir()
    (fake / "wandb.py").write_text(FAKE_WANDB)
    monkeypatch.syspath_prepend(str(fake))  # importable, so only the code's choice keeps it out
    monkeypatch.delitem(sys.modules, "wandb", raising=False)
    cfg = tiny_config(1, corpus, mbs=2, gbs=4, train_iters=2, eval_iters=0)
    cfg.logging.run_dir, cfg.logging.log_interval, cfg.logging.progress = str(tmp_path / "run"), 1, False
    cfg.logging.peak_tflops = 0.5
    out = io.StringIO()
    assert run(cfg, stream=out) == 0
    assert "wandb" not in sys.modules  # not asked for: never imported
    run_dir = tmp_path / "run"
    source, _, plan = compile_run(cfg)
    from specc.plan import plan_json, plan_text

    assert (run_dir / "model.py").read_text() == source
    assert (run_dir / "plan.txt").read_text() == plan_text(plan)
    assert (run_dir / "plan.json").read_text() == plan_json(plan)
    lines = out.getvalue().splitlines()
    assert lines[0].startswith("peak 0.500 TFLOP/s per rank, given by --peak-tflops")
    flops = plan.totals["flops_per_step"] * 2  # two micro-batches
    assert f"FLOPs per rank {flops:,}" in lines[0]
    (memory,) = [ln for ln in lines if ln.startswith("memory per rank, plan / measured")]
    t = plan.totals
    from specc.plan.render import human_bytes

    for name, key in (("parameters", "parameter_bytes"), ("gradients", "gradient_bytes"),
                      ("optimizer", "optimizer_bytes")):  # fp32 tensors: plan and measurement agree exactly
        assert f"{name} {human_bytes(t[key])} / {human_bytes(t[key])}" in memory
    logs = [ln for ln in lines if "consumed samples" in ln]
    assert len(logs) == 2 and all("throughput per GPU (TFLOP/s/GPU): " in ln and "| MFU: " in ln for ln in logs)
    records = [json.loads(ln) for ln in open(run_dir / "metrics.jsonl")]
    for r in records:
        assert r["tflops_per_rank"] == pytest.approx(flops / r["step_time_s"] / 1e12)
        assert r["mfu"] == pytest.approx(r["tflops_per_rank"] / 0.5)

    # The model is imported from the run directory's model.py: a traceback inside it shows its lines.
    from runtime.api import load_module_from_file

    module = load_module_from_file(str(run_dir / "model.py"))
    model = module.build_model(ProcessGroups.single())
    with pytest.raises(Exception) as info:
        model(torch.zeros(1, 8), torch.zeros(1, 8, dtype=torch.long))  # float token ids
    text = "".join(traceback.format_exception(info.value))
    assert f'File "{run_dir / "model.py"}"' in text and "embedding_out = self.embedding(tokens)" in text

    # Asked for, W&B gets the run's configuration and the same scalars as TensorBoard.
    cfg.logging.wandb_project, cfg.logging.wandb_exp_name = "specc-test", "tiny"
    cfg.logging.run_dir, cfg.train_iters = str(tmp_path / "wandb_run"), 1
    try:
        assert run(cfg, stream=io.StringIO()) == 0
    finally:
        sys.modules.pop("wandb", None)  # the fake stays out of the other tests
    calls = json.load(open(tmp_path / "wandb_run" / "wandb_calls.json"))
    assert calls[0] == ["init", "specc-test", "tiny", ["model", "train"]]
    assert calls[1][:2] == ["log", 1] and {"lm loss", "throughput/mfu", "learning-rate"} <= set(calls[1][2])
    assert calls[-1] == ["finish"]


def test_wandb_asked_for_but_not_installed_is_one_line(tmp_path):
    import importlib.util

    if importlib.util.find_spec("wandb") is not None:
        pytest.skip("wandb is installed here")
    cfg = tiny_config(1, str(tmp_path), train_iters=1)
    cfg.logging.wandb_project = "p"
    assert resolve(cfg, 1) == ["--wandb-project p: the wandb package is not installed (pip install wandb, or leave "
                               "out --wandb-project)"]
    cfg.logging.wandb_project, cfg.logging.wandb_exp_name, cfg.logging.peak_tflops = None, "x", 0.0
    assert resolve(cfg, 1) == ["--peak-tflops must be positive, got 0.0", "--wandb-exp-name needs --wandb-project NAME"]
