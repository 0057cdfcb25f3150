"""specc train's FLOPs per rank: at PP each pipeline rank's own stages (the whole model's count
made TFLOP/s and MFU read PP times too high), at EP the rank's own tokens' expert rows."""

from __future__ import annotations

import os

import pytest

from runtime.train.config import ParallelConfig, TrainConfig, resolve
from specc_torch.train import rank_flops
from specc_torch.train_compile import compile_run

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))


def _totals(spec: str, world: int, **parallel) -> dict:
    cfg = TrainConfig(spec=os.path.join(ROOT, "specs", spec), parallel=ParallelConfig(**parallel),
                      micro_batch_size=1, global_batch_size=8, overrides={"num_layers": 4})
    assert resolve(cfg, world) == []
    return compile_run(cfg)[2].totals


@pytest.mark.parametrize("spec", ["gpt-tiny.yaml", "mixtral-tiny.yaml"])
def test_pipeline_ranks_count_their_own_stages(spec):
    whole = _totals(spec, 1)["flops_per_step"]
    totals = _totals(spec, 2, pp=2)
    mine = [rank_flops(totals, r) for r in range(2)]
    assert sum(mine) == totals["flops_per_step"] == whole
    assert all(0 < m < whole for m in mine)
    totals = _totals(spec, 2, pp=2, pp_virtual_stage_layers=1)  # interleaved: two stages per rank
    assert sum(rank_flops(totals, r) for r in range(2)) == whole


def test_expert_parallel_ranks_count_their_own_tokens():
    single = _totals("mixtral-tiny.yaml", 1)
    experts = _totals("mixtral-tiny.yaml", 2, ep=2)
    assert rank_flops(experts) == rank_flops(single) == single["flops_per_step"] > 0
