"""The real thing: runtime.optim.Adam with the distributed optimizer (state sharded over DP) on
TP=2 x DP=2, saved through adam_state, then loaded (a) on the same layout, where the next step's
loss is bit-identical to not stopping, and (b) in one process with the replicated optimizer at
TP=1, where the next loss is the same to float tolerance."""

from __future__ import annotations

import pytest
import torch
from ckpt_helpers import GPT, batch

import runtime
import specc_torch
from runtime.checkpoint import load_checkpoint, save_checkpoint
from runtime.checkpoint.adam import adam_state, restore_adam
from runtime.ddp import DistributedDataParallel
from runtime.optim import Adam
from runtime.parallel_state import ProcessGroups

STEPS, LR, GLOBAL_BATCH = 2, 0.01, 4


def _setup(pg, seed, distributed):
    model = specc_torch.build_model(GPT, pg, seed=seed, sp=pg.tp.size > 1)
    ddp = DistributedDataParallel(model, pg, bucket_size=20_000,
                                  grad_reduce="reduce_scatter" if distributed else "all_reduce")
    return model, ddp, Adam(ddp, pg, distributed=distributed, clip_grad=1.0)


def _rows(pg, position):
    """Global batch `position` (4 samples); each DP rank its share."""
    tokens, labels = batch(position, b=GLOBAL_BATCH)
    per = GLOBAL_BATCH // pg.dp.size
    rows = slice(pg.dp.rank * per, (pg.dp.rank + 1) * per)
    return tokens[rows], labels[rows]


def _mean_over_dp(loss, pg) -> float:
    total = loss.detach().reshape(1).clone()
    runtime.all_reduce(total, pg.dp)
    return total.item() / pg.dp.size


def _step(model, ddp, opt, pg, position) -> tuple[float, float]:
    """One step on global batch `position`; (its loss, the loss after the step on the next batch):
    the second depends on the optimizer state the step used."""
    ddp.zero_grad_buffer()
    loss = ddp(*_rows(pg, position)).mean()
    loss.backward()
    runtime.finalize_model_grads(model, pg, ddp)
    opt.step(LR)
    with torch.no_grad():
        after = model(*_rows(pg, position + 1)).mean()
    return _mean_over_dp(loss, pg), _mean_over_dp(after, pg)


def _train_and_save(rank, world, directory):
    pg = ProcessGroups.initialize(tp=2)
    try:
        model, ddp, opt = _setup(pg, seed=1, distributed=True)
        for position in range(STEPS):
            _step(model, ddp, opt, pg, position)
        save_checkpoint(directory, STEPS, model, pg, optimizer_state=adam_state(opt, model),
                        data_state={"consumed_samples": STEPS})
        return _step(model, ddp, opt, pg, STEPS), opt.state_bytes()
    finally:
        pg.destroy()


def _resume(rank, world, directory, tp, distributed):
    pg = ProcessGroups.initialize(tp=tp) if world > 1 else ProcessGroups.single()
    try:
        model, ddp, opt = _setup(pg, seed=2, distributed=distributed)
        out = load_checkpoint(directory, model, pg, optimizer_state=adam_state(opt, model))
        restore_adam(opt, out["optimizer_state"])
        assert opt.step_count == STEPS and out["data_state"] == {"consumed_samples": STEPS}
        return _step(model, ddp, opt, pg, out["data_state"]["consumed_samples"]), opt.state_bytes()
    finally:
        pg.destroy()


def test_distributed_adam_state_resumes_and_reshards(gloo, tmp_path):
    directory = str(tmp_path / "ckpt")
    (expected, sharded_bytes), *_ = gloo.run(4, _train_and_save, directory)
    same, _ = gloo.run(4, _resume, directory, 2, True)[0]
    assert same == expected  # bit-identical on the layout that saved
    single, full_bytes = _resume(0, 1, directory, 1, False)
    assert single == pytest.approx(expected, rel=1e-5)
    assert sharded_bytes < full_bytes / 3  # each saving rank held about 1/(TP*DP) of the state
    # without the optimizer state (fresh Adam moments) the step goes elsewhere: the state mattered
    model, ddp, opt = _setup(ProcessGroups.single(), seed=2, distributed=False)
    load_checkpoint(directory, model)
    fresh = _step(model, ddp, opt, ProcessGroups.single(), STEPS)
    assert fresh[0] == pytest.approx(expected[0], rel=1e-5) and fresh[1] != pytest.approx(expected[1], rel=1e-3)


def test_bf16_parameters_resume_with_their_fp32_master_weights(tmp_path):
    def setup(seed):
        model = specc_torch.build_model(GPT, seed=seed).to(torch.bfloat16)
        ddp = DistributedDataParallel(model, ProcessGroups.single(), bucket_size=20_000)
        return model, ddp, Adam(ddp, ProcessGroups.single())

    pg = ProcessGroups.single()
    model, ddp, opt = setup(1)
    _step(model, ddp, opt, pg, 0)
    state = adam_state(opt, model)
    assert set(state) == {"step", "exp_avg", "exp_avg_sq", "master"}  # fp32 masters are state too
    save_checkpoint(str(tmp_path), 1, model, optimizer_state=state)
    expected = _step(model, ddp, opt, pg, 1)

    model, ddp, opt = setup(2)
    out = load_checkpoint(str(tmp_path), model, optimizer_state=adam_state(opt, model))
    restore_adam(opt, out["optimizer_state"])
    assert _step(model, ddp, opt, pg, 1) == expected
