"""Training with context parallelism against single-process math: CP=2 (alone, with DP=2 and
the distributed optimizer, and under TP=2 + SP) follows CP=1 step for step from the same
weights (loss, gradients, grad norm: nothing counted twice over CP), CP ranks stay exact
replicas, and a TP=2 x CP=2 checkpoint loads at TP=1 x CP=1 with the same validation loss."""

from __future__ import annotations

import glob
import os

import pytest
import torch
from train_helpers import (
    assert_params_close,
    assert_steps_agree,
    distinct_traces,
    make_corpus,
    run_steps,
    tiny_config,
)

from runtime.checkpoint import adam_state, dcp, load_checkpoint, read_info, restore_adam, save_checkpoint
from runtime.data import build_datasets
from runtime.parallel_state import ProcessGroups
from runtime.train.config import split_weights
from runtime.train.training import evaluate, setup_model_and_optimizer
from specc_torch.train_compile import compile_model

STEPS = 3


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return make_corpus(str(tmp_path_factory.mktemp("cp")))


def _cp_run(rank, world, data, tp, cp, dist_opt):
    pg = ProcessGroups.initialize(tp=tp, cp=cp)
    try:
        cfg = tiny_config(world, data, tp=tp, sp=tp > 1, cp=cp, dist_opt=dist_opt, bucket=25_000)
        assert (pg.tp.size, pg.cp.size, pg.dp.size) == (tp, cp, world // (tp * cp))
        trace = {}
        run_steps(cfg, pg, STEPS, trace=trace)
        return pg.cp.rank, trace
    finally:
        pg.destroy()


@pytest.mark.parametrize("world,tp,cp,dist_opt", [(2, 1, 2, False), (4, 1, 2, True), (4, 2, 2, False)],
                         ids=["cp2", "cp2-dp2-distributed-optimizer", "tp2-sp-cp2"])
def test_cp_follows_cp1(gloo, corpus, world, tp, cp, dist_opt):
    ref_cfg = tiny_config(1, corpus)
    results = gloo.run(world, _cp_run, corpus, tp, cp, dist_opt)
    for got in distinct_traces([trace for _, trace in results]):  # one reference run for identical ranks
        ref = {}
        run_steps(ref_cfg, ProcessGroups.single(), STEPS, trace=ref, follow=got)
        assert ref["losses"][-1] < ref["losses"][0]
        assert_steps_agree(got, ref, ref_cfg.optimizer, [ref_cfg.optimizer.lr] * STEPS)
    by_cp = {}
    for cp_rank, got in results:
        by_cp.setdefault(cp_rank, got)
    assert sorted(by_cp) == list(range(cp))
    for cp_rank, got in by_cp.items():  # CP ranks: the same loss, norm and weights, bit for bit
        assert got["losses"] == by_cp[0]["losses"] and got["norms"] == by_cp[0]["norms"]
        assert_params_close(got["after"][-1], by_cp[0]["after"][-1], rtol=0, atol=0)


def _validation_loss(setup, cfg, pg) -> float:
    valid = build_datasets(cfg.data.data_path, setup.spec.config["seq_length"], cfg.seed,
                           split_weights(cfg.data.split))["valid"]
    return evaluate(setup, valid, cfg, pg)


def _save_after_steps(rank, world, data, directory, tp, cp):
    pg = ProcessGroups.initialize(tp=tp, cp=cp)
    try:
        cfg = tiny_config(world, data, tp=tp, sp=tp > 1, cp=cp, eval_iters=2)
        *_, setup = run_steps(cfg, pg, 2)
        save_checkpoint(directory, 2, setup.model, pg, optimizer_state=adam_state(setup.optimizer, setup.model),
                        scheduler_state={"iteration": 2}, data_state={"consumed_samples": 16},
                        rng_tracker=setup.rng_tracker, config=cfg.to_dict())
        return _validation_loss(setup, cfg, pg)
    finally:
        pg.destroy()


def _load_and_validate(rank, world, data, directory, tp, cp):
    pg = ProcessGroups.initialize(tp=tp, cp=cp) if world > 1 else ProcessGroups.single()
    try:
        cfg = tiny_config(world, data, tp=tp, sp=tp > 1, cp=cp, eval_iters=2)
        setup = setup_model_and_optimizer(cfg, pg, compiled=compile_model(cfg))
        with torch.no_grad():  # nothing of the initial weights may survive the load
            for p in setup.model.parameters():
                p.fill_(float("nan"))
        out = load_checkpoint(directory, setup.model, pg, optimizer_state=adam_state(setup.optimizer, setup.model),
                              rng_tracker=setup.rng_tracker)
        restore_adam(setup.optimizer, out["optimizer_state"])
        return out["resharded"], setup.optimizer.step_count, _validation_loss(setup, cfg, pg)
    finally:
        pg.destroy()


def _shared_bytes(path: str) -> int:
    """Bytes in a checkpoint's DCP files, less each rank's own entries (its RNG states)."""
    own = sum(info.length for index, info in dcp.read_metadata(path).storage_data.items()
              if index.fqn.startswith("rank/"))
    return sum(os.path.getsize(f) for f in glob.glob(os.path.join(path, "*.distcp"))) - own


def test_tp2_cp2_checkpoint_loads_at_tp1_cp1_and_cp2_with_the_same_validation_loss(gloo, corpus, tmp_path):
    directory = str(tmp_path / "tp2cp2")
    saved = gloo.run(4, _save_after_steps, corpus, directory, 2, 2)
    assert len(set(saved)) == 1  # every rank evaluated the same (gathered) per-token losses
    info = read_info(os.path.join(directory, "step_0000002"))
    assert info["layout"] == {"tp": 2, "cp": 2, "dp": 1, "pp": 1, "world_size": 4}
    assert info["config"]["parallel"]["cp"] == 2
    # Validation loss from the same weights: per-token losses summed in another order (TP shards,
    # CP chunks), a few float32 roundings of ~1e-7 relative each.
    for world, tp, cp in ((1, 1, 1), (2, 1, 2)):
        results = [_load_and_validate(0, 1, corpus, directory, 1, 1)] if world == 1 else \
            gloo.run(world, _load_and_validate, corpus, directory, tp, cp)
        for resharded, step, loss in results:
            assert resharded and step == 2, (tp, cp)
            assert loss == pytest.approx(saved[0], rel=1e-5), (tp, cp)

    # CP ranks are replicas: each parameter and optimizer block is written once, so the files
    # hold what TP=2 x CP=1 writes, byte for byte, but for every rank's own RNG states.
    single = str(tmp_path / "tp2cp1")
    gloo.run(2, _save_after_steps, corpus, single, 2, 1)
    once = _shared_bytes(os.path.join(single, "step_0000002"))
    assert _shared_bytes(os.path.join(directory, "step_0000002")) == once > 3 * 4 * 100_000  # weights, 2 moments


def test_the_rules_with_context_parallelism():
    from runtime.train.config import ParallelConfig, TrainConfig, resolve

    cfg = TrainConfig(spec="x.yaml", parallel=ParallelConfig(tp=2, cp=2), micro_batch_size=2, global_batch_size=8)
    assert resolve(cfg, 8) == [] and cfg.parallel.dp == 2 and cfg.num_micro_batches == 2  # world = TP x CP x DP
    cfg = TrainConfig(spec="x.yaml", parallel=ParallelConfig(tp=2, cp=2))
    assert resolve(cfg, 6) == ["world size 6 is not divisible by TP*CP*PP = 2*2*1 = 4 (world = TP*CP*DP*PP)"]
    cfg = TrainConfig(spec="x.yaml", parallel=ParallelConfig(cp_comm_type="p2p"))
    assert resolve(cfg, 1) == ["--cp-comm-type has no effect without context parallelism (add "
                               "--context-parallel-size N, or drop --cp-comm-type)"]
    cfg = TrainConfig(spec="x.yaml", parallel=ParallelConfig(cp=2, cp_comm_type="ring"))
    assert resolve(cfg, 2) == ["--cp-comm-type must be one of auto, p2p, all_gather, got 'ring'"]
