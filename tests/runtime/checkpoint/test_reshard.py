"""Resharding on load: a checkpoint saved at TP=2 x DP=2 (4 gloo ranks, with a distributed-
optimizer state sharded over DP) loads at TP=1, TP=4, TP=2 x DP=1 and TP=1 x DP=2 with the same
full parameters and optimizer state, the same loss, and the same loss after one more step."""

from __future__ import annotations

import os
import shutil

import pytest
import torch
from ckpt_helpers import GPT, LLAMA, FlatState, expected_weights, full_weights, loss_of, set_weights

import runtime
import specc_torch
from runtime.checkpoint import CheckpointError, latest_step, load_checkpoint, read_info, save_checkpoint
from runtime.parallel_state import ProcessGroups

LR = 0.5


def _save(rank, world, directory, spec, tp):
    pg = ProcessGroups.initialize(tp=tp)
    try:
        model = specc_torch.build_model(spec, pg, seed=1, sp=tp > 1)
        set_weights(model)
        state = FlatState(model, pg)
        state.fill_expected()
        loss = loss_of(model).item()
        save_checkpoint(directory, 5, model, pg, optimizer_state={"step": 5, "exp_avg": state.shards()},
                        scheduler_state={"lr": LR}, data_state={"consumed_samples": 40}, config={"tp": tp})
        return loss
    finally:
        pg.destroy()


@torch.no_grad()
def _momentum_step(model, state: FlatState) -> None:
    for name, shard in state.shards().items():
        p = dict(model.named_parameters())[name]
        p.view(-1).sub_(LR * (0.9 * shard.tensor + p.grad.reshape(-1)))


def _load(rank, world, directory, spec, tp):
    pg = ProcessGroups.initialize(tp=tp) if world > 1 else ProcessGroups.single()
    try:
        model = specc_torch.build_model(spec, pg, seed=2, sp=tp > 1)  # other weights: all must come from the file
        state = FlatState(model, pg)
        out = load_checkpoint(directory, model, pg, optimizer_state={"step": 0, "exp_avg": state.shards()})
        expected = expected_weights(spec)
        full = full_weights(model, pg)
        result = {
            "weights_equal": all(torch.equal(full[n], expected[n]) for n in expected),
            "optimizer_equal": state.matches_expected(),
            "step": out["optimizer_state"]["step"], "scheduler": out["scheduler_state"], "data": out["data_state"],
            "resharded": out["resharded"], "rng_restored": out["rng_restored"], "config": out["config"],
        }
        loss = loss_of(model)
        result["loss"] = loss.item()
        if pg.dp.size == 1:  # one more step with the loaded optimizer state: training continues alike
            loss.backward()
            runtime.finalize_model_grads(model, pg)
            _momentum_step(model, state)
            result["loss_after_step"] = loss_of(model, 1).item()
        return result
    finally:
        pg.destroy()


def test_save_at_tp2_dp2_loads_at_tp1_tp4_and_dp1(gloo, tmp_path):
    directory = str(tmp_path / "ckpt")
    saved_loss = gloo.run(4, _save, directory, GPT, 2)[0]
    info = read_info(os.path.join(directory, "step_0000005"))
    assert info["layout"] == {"tp": 2, "cp": 1, "dp": 2, "pp": 1, "world_size": 4}
    assert info["params"]["layers.0.self_attention.linear_qkv.weight"]["shape"] == [192, 64]  # full shape
    assert "output_layer.weight" not in info["params"]  # tied: stored once, as embedding.weight
    assert latest_step(directory) == 5

    results = {
        "tp1": _load(0, 1, directory, GPT, 1),
        "tp4": gloo.run(4, _load, directory, GPT, 4)[0],
        "tp2_dp1": gloo.run(2, _load, directory, GPT, 2)[0],
        "tp1_dp2": gloo.run(2, _load, directory, GPT, 1)[0],
    }
    for name, r in results.items():
        assert r["weights_equal"] and r["optimizer_equal"], name  # bit-exact, whatever the layout
        assert (r["step"], r["scheduler"], r["data"], r["config"]) == (5, {"lr": LR}, {"consumed_samples": 40},
                                                                        {"tp": 2}), name
        assert r["resharded"] and not r["rng_restored"], name
        assert r["loss"] == pytest.approx(saved_loss, rel=1e-5, abs=1e-6), name
    after = [r["loss_after_step"] for r in results.values() if "loss_after_step" in r]
    assert len(after) == 3 and max(after) - min(after) < 1e-5


KV2 = {"overrides": {"num_query_groups": 2}}  # 2 K/V heads: replicated over 2 ranks each at TP=4


def _reshard_llama_on_ranks(rank, world, source, directory):
    """At TP=world: load `source` (saved at another TP), then save it again at this TP into `directory`."""
    pg = ProcessGroups.initialize(tp=world)
    try:
        model = specc_torch.build_model(LLAMA, pg, seed=2, sp=True, **KV2)
        out = load_checkpoint(source, model, pg)
        expected = expected_weights(LLAMA, **KV2)
        full = full_weights(model, pg)
        equal = all(torch.equal(full[n], expected[n]) for n in expected)
        if directory is not None:
            save_checkpoint(directory, 1, model, pg)
        return equal, loss_of(model).item(), out["resharded"]
    finally:
        pg.destroy()


def test_grouped_query_segments_reshard_between_tp1_tp2_and_tp4(gloo, tmp_path):
    """Llama's fused [q | k | v] with 2 K/V heads, and [gate | up]: saved at TP=1, loaded at TP=4
    (each K/V head replicated over 2 ranks) and saved there (a replicated head is one box, written
    once), then loaded at TP=2 (one head per rank) and TP=1: the same full weights and loss."""
    tp1, tp4 = str(tmp_path / "tp1"), str(tmp_path / "tp4")
    model = specc_torch.build_model(LLAMA, seed=1, **KV2)
    set_weights(model)
    saved_loss = loss_of(model).item()
    save_checkpoint(tp1, 1, model)
    equal4, loss4, resharded4 = gloo.run(4, _reshard_llama_on_ranks, tp1, tp4)[0]
    assert equal4 and resharded4 and loss4 == pytest.approx(saved_loss, rel=1e-5)
    assert read_info(os.path.join(tp4, "step_0000001"))["layout"]["tp"] == 4
    equal2, loss2, resharded2 = gloo.run(2, _reshard_llama_on_ranks, tp4, None)[0]
    assert equal2 and resharded2 and loss2 == pytest.approx(saved_loss, rel=1e-5)
    model = specc_torch.build_model(LLAMA, seed=3, **KV2)
    load_checkpoint(tp4, model)
    expected = expected_weights(LLAMA, **KV2)
    assert all(torch.equal(p, expected[n]) for n, p in model.named_parameters())
    assert loss_of(model).item() == pytest.approx(saved_loss, rel=1e-5)


def _load_expecting_error(rank, world, directory):
    pg = ProcessGroups.initialize(tp=world)
    try:
        model = specc_torch.build_model(GPT, pg, seed=2, sp=True)
        before = [p.detach().clone() for p in model.parameters()]
        try:
            load_checkpoint(directory, model, pg)
        except CheckpointError as e:
            unchanged = all(torch.equal(a, p) for a, p in zip(before, model.parameters()))
            return str(e), unchanged
        return None, None
    finally:
        pg.destroy()


def _save_tp2(rank, world, directory):
    pg = ProcessGroups.initialize(tp=world)
    try:
        model = specc_torch.build_model(GPT, pg, seed=1, sp=True)
        save_checkpoint(directory, 2, model, pg)
    finally:
        pg.destroy()


def test_a_missing_shard_fails_on_every_rank_with_the_same_message(gloo, tmp_path):
    directory = str(tmp_path / "ckpt")
    gloo.run(2, _save_tp2, directory)
    step = os.path.join(directory, "step_0000002")
    shards = sorted(f for f in os.listdir(step) if f.endswith(".distcp"))
    assert shards == ["__0_0.distcp", "__1_0.distcp"]  # each rank wrote its own blocks
    os.remove(os.path.join(step, "__1_0.distcp"))
    results = gloo.run(2, _load_expecting_error, directory)
    assert results[0] == results[1]
    message, unchanged = results[0]
    assert message == f"{step}: file __1_0.distcp is missing" and unchanged
    shutil.rmtree(directory)
