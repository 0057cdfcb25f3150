"""Pipeline parallelism against PP=1 (issue 12): loss at every step, every gradient (gathered over
TP, collected over the stages, the tied embedding on both of its ends) and the weights after SGD
steps, from the initial and from randomized weights. One spawn of 4 gloo ranks per spec runs
every setting: PP=2 (which 4 ranks make PP=2 x DP=2, each DP rank its half of the batch), PP=4,
PP=2 x TP=2 with SP, and interleaved PP=2 x V=2; 4 layers of hidden size 32."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from specc_torch.verify import VerifyConfig, verify

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
SMALL = {"num_layers": 4, "hidden_size": 32}


def _failures(rows):
    return [f"{r.setting}: {r.quantity}: {r.detail}" for r in rows if not r.ok]


def test_gpt_tiny_pipeline_settings_match_pp1():
    cfg = VerifyConfig(spec=os.path.join(ROOT, "specs", "gpt-tiny.yaml"), tps=[1], sps=[True], batch=4,
                       overrides=SMALL, pp_settings=[(2, None, 1, 1, False), (4, None, 1, 1, False),
                                                     (2, None, 2, 1, True), (2, 1, 1, 1, False)])
    rows = verify(cfg)
    assert not _failures(rows), _failures(rows)
    settings = {r.setting for r in rows}
    assert {"pp=2 dp=2 tp=1 sp=off", "pp=4 tp=1 sp=off", "pp=2 tp=2 sp=on", "pp=2 vpp=1 dp=2 tp=1 sp=off"} <= settings
    pipeline_rows = [r for r in rows if r.setting.startswith("pp=")]
    assert len(pipeline_rows) == 4 * 2 * 3  # loss, gradients, weights; from two starting points
    # the PP=1 model's 52 parameters, and the tied word embedding's copy on the last stage
    assert all(r.detail == "53 tensors" for r in pipeline_rows if "gradients" in r.quantity)


def test_llama_tiny_pipeline_with_tensor_parallelism_and_interleaving():
    cfg = VerifyConfig(spec=os.path.join(ROOT, "specs", "llama-tiny.yaml"), tps=[1], sps=[True], batch=4,
                       overrides={"num_layers": 4}, pp_settings=[(2, 1, 2, 1, True)])
    rows = verify(cfg)
    assert not _failures(rows), _failures(rows)
    assert "pp=2 vpp=1 tp=2 sp=on" in {r.setting for r in rows}


@pytest.mark.parametrize("flags, message", [
    (["--pp", "2", "--batch", "1"], "--batch 1: error: PP=2 runs on 2 ranks with DP=1: the batch must split into 1 "
                                    "equal shares of at least 2 micro-batches (use --batch 2)"),
])
def test_verify_pipeline_errors_before_starting_ranks(flags, message):
    out = subprocess.run([sys.executable, "-m", "specc_cli", "verify", "specs/gpt-tiny.yaml", "--tp", "1", *flags],
                         cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and out.stderr.strip() == message
