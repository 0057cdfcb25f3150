"""Activation memory per rank under context parallelism is what the plan says: the bytes autograd
saves for backward in the compiled gpt at CP=1 and CP=2 match `specc plan --cp N --json`'s
activation_bytes (at CP=2 half of CP=1's), but for the norms' per-token statistics."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

import specc_torch
from runtime.parallel_state import ProcessGroups

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SPEC = os.path.join(ROOT, "specs", "gpt.yaml")
CONFIG = {"vocab_size": 512, "hidden_size": 64, "num_layers": 2, "num_attention_heads": 4, "seq_length": 256}
BATCH = 2


def _plan_bytes(cp: int) -> int:
    cmd = [sys.executable, "-m", "specc_cli", "plan", SPEC, "--json", "--dtype", "fp32", "--micro-batch-size",
           str(BATCH), "--cp", str(cp)] + [a for k, v in CONFIG.items() for a in ("--set", f"{k}={v}")]
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, check=True).stdout
    return json.loads(out)["totals"]["activation_bytes"]


def _saved_bytes(rank, world):
    pg = ProcessGroups.initialize(cp=world) if world > 1 else ProcessGroups.single()
    try:
        model = specc_torch.build_model(SPEC, pg, seed=1, overrides=CONFIG, micro_batch_size=BATCH)
        params = {p.untyped_storage().data_ptr() for p in model.parameters()}
        seen = {}

        def pack(t):
            storage = t.untyped_storage()
            if storage.data_ptr() not in params:
                seen[storage.data_ptr()] = (storage.nbytes(), t.dtype)
            return t

        g = torch.Generator().manual_seed(0)
        tokens = torch.randint(0, CONFIG["vocab_size"], (BATCH, CONFIG["seq_length"]), generator=g)
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            model(tokens, torch.roll(tokens, -1, 1)).mean().backward()
        floats = sum(n for n, dtype in seen.values() if dtype.is_floating_point)
        return floats, sum(n for n, _ in seen.values()) - floats
    finally:
        pg.destroy()


def test_saved_activations_match_the_plan_at_cp1_and_cp2(gloo):
    plan1, plan2 = _plan_bytes(1), _plan_bytes(2)
    assert plan2 * 2 == pytest.approx(plan1, rel=0.01)
    for measured, plan in ((_saved_bytes(0, 1), plan1), (gloo.run(2, _saved_bytes)[0], plan2)):
        floats, _ = measured  # the int64 token and label indices saved are not activations
        # One storage per tensor: the attention output, which the projection after it saves too,
        # counts once, as in the plan (saved twice at CP=2 it was 5% over). What the plan leaves
        # out is the norms' mean and rstd, two fp32 values per token and norm: 0.4% here.
        assert plan <= floats <= 1.01 * plan, (floats, plan)
