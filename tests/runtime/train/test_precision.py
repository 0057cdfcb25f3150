"""Every precision trains on every axis: the first steps' loss and gradient norm at bf16 and fp16
(dynamic loss scaling) against fp32, from the same initial weights, at PP 2, TP 2, CP 2 and EP 2.

A precision that is silently not applied somewhere (fp16's loss scale missing from the pipeline's
loss function while the optimizer still divides by it: a gradient norm ~1e-10 of fp32's, the loss
flat, no step skipped) fails here on the norm, whatever the loss does."""

from __future__ import annotations

import pytest
from train_helpers import GPT_TINY, ROOT, make_corpus, run_steps, tiny_config

from runtime.parallel_state import ProcessGroups
from runtime.train.config import LossScaleConfig

MIXTRAL_TINY = f"{ROOT}/specs/mixtral-tiny.yaml"

# Relative tolerances of the first step's loss and gradient norm against fp32. The low-precision
# runs round every matmul's inputs (bf16: 8 significant bits, 2^-8 = 0.4%; fp16: 11, 0.05%) and
# the norms' and softmax's outputs; summed over a few layers the loss moves by well under 1% and
# the gradient norm by a few percent at bf16. The failure these catch is of another order (a norm
# off by a factor of the loss scale, 2^12 here, or a loss that does not move).
LOSS_RTOL = {"bf16": 2e-2, "fp16": 5e-3}
NORM_RTOL = {"bf16": 1e-1, "fp16": 2e-2}
# 2^12: large enough that a missing scale shows as a norm 4096 times too small, small enough that
# the tiny model's gradients do not overflow fp16 (so no step is skipped).
LOSS_SCALE = 2.0 ** 12

AXES = {
    "pp2": dict(parallel=dict(pp=2), spec=GPT_TINY, gbs=4, mbs=1),
    "tp2": dict(parallel=dict(tp=2, sp=True), spec=GPT_TINY, gbs=4, mbs=2),
    "cp2": dict(parallel=dict(cp=2), spec=GPT_TINY, gbs=4, mbs=2),
    "ep2": dict(parallel=dict(ep=2), spec=MIXTRAL_TINY, gbs=4, mbs=1),
}


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return make_corpus(str(tmp_path_factory.mktemp("precision")))


def _steps(rank, world, data, axis):
    case = AXES[axis]
    par = case["parallel"]
    pg = ProcessGroups.initialize(tp=par.get("tp", 1), cp=par.get("cp", 1), pp=par.get("pp", 1), ep=par.get("ep", 1))
    out = {}
    try:
        for precision in ("fp32", "bf16", "fp16"):
            cfg = tiny_config(world, data, spec=case["spec"], mbs=case["mbs"], gbs=case["gbs"],
                              bf16=precision == "bf16", fp16=precision == "fp16",
                              loss_scale=LossScaleConfig(initial_loss_scale=LOSS_SCALE), **par)
            losses, norms, _, setup = run_steps(cfg, pg, 2)
            scaler = setup.optimizer.grad_scaler
            out[precision] = {"losses": losses, "norms": norms,
                              "scale": scaler.scale if scaler is not None else None}
        return out
    finally:
        pg.destroy()


@pytest.mark.parametrize("axis", sorted(AXES))
def test_bf16_and_fp16_train_like_fp32(gloo, corpus, axis):
    for rank, got in enumerate(gloo.run(2, _steps, corpus, axis)):
        ref = got["fp32"]
        for precision in ("bf16", "fp16"):
            run = got[precision]
            where = f"{axis} rank {rank} {precision}"
            assert run["losses"][0] == pytest.approx(ref["losses"][0], rel=LOSS_RTOL[precision]), where
            assert run["norms"][0] == pytest.approx(ref["norms"][0], rel=NORM_RTOL[precision]), where
            # the second step starts from weights the first moved: it trains (not skipped, not flat)
            assert run["norms"][1] == pytest.approx(ref["norms"][1], rel=2 * NORM_RTOL[precision]), where
        assert got["fp16"]["scale"] == LOSS_SCALE, f"{axis}: no step may overflow at this scale"
