"""Bad checkpoints fail with one clear line naming what does not match, and load nothing: a missing
or truncated or corrupted file, an interrupted save, another spec, other shapes, optimizer state
that cannot be resharded, and misuse at save time."""

from __future__ import annotations

import json
import os

import pytest
import torch
from ckpt_helpers import GPT, LLAMA

import specc_torch
from runtime.checkpoint import (
    CheckpointError,
    ParamShard,
    RankLocal,
    load_checkpoint,
    read_tensors,
    save_checkpoint,
)
from runtime.parallel_state import ProcessGroups


@pytest.fixture
def saved(tmp_path):
    directory = str(tmp_path / "ckpt")
    model = specc_torch.build_model(GPT, seed=1)
    save_checkpoint(directory, 7, model, optimizer_state={"step": 7, "m": {"embedding.weight": ParamShard(
        "embedding.weight", torch.ones_like(model.embedding.weight))}})
    return directory, os.path.join(directory, "step_0000007")


def _fails(directory, model=None, **kw) -> str:
    model = model if model is not None else specc_torch.build_model(GPT, seed=2)
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(CheckpointError) as e:
        load_checkpoint(directory, model, **kw)
    assert all(torch.equal(a, p) for a, p in zip(before, model.parameters())), "a failed load changed the model"
    message = str(e.value)
    assert "\n" not in message
    return message


def test_missing_truncated_and_corrupt_files(saved):
    directory, step = saved
    shard = os.path.join(step, "__0_0.distcp")
    data = open(shard, "rb").read()

    with open(shard, "wb") as f:
        f.write(data[: len(data) // 3])
    assert _fails(directory) == (f"{step}: file __0_0.distcp has {len(data) // 3} bytes, {len(data)} were written "
                                 f"(truncated)")

    corrupt = bytearray(data)
    corrupt[len(data) // 2] ^= 0xFF
    with open(shard, "wb") as f:
        f.write(corrupt)
    assert _fails(directory).startswith(f"{step}: file __0_0.distcp is corrupt (crc32 ")

    os.remove(shard)
    assert _fails(directory) == f"{step}: file __0_0.distcp is missing"
    with pytest.raises(CheckpointError, match="file __0_0.distcp is missing"):
        read_tensors(directory)

    with open(shard, "wb") as f:
        f.write(data)
    os.remove(os.path.join(step, ".metadata"))
    assert _fails(directory) == f"{step}: file .metadata is missing"


def test_interrupted_or_absent_checkpoints(saved, tmp_path):
    directory, step = saved
    assert _fails(str(tmp_path / "nothing")) == f"{tmp_path / 'nothing'}: no such directory"
    os.makedirs(tmp_path / "empty")
    assert _fails(str(tmp_path / "empty")) == f"{tmp_path / 'empty'}: no checkpoint here (no 'latest' file)"
    assert _fails(directory, step=3) == f"{directory}/step_0000003: no such checkpoint"
    with open(os.path.join(step, "checkpoint.json"), "r+") as f:
        text = f.read()
        f.seek(0)
        f.truncate()
        f.write(text[:100])
    assert _fails(directory).startswith(f"{step}: checkpoint.json is corrupt (")
    os.remove(os.path.join(step, "checkpoint.json"))
    assert _fails(directory) == f"{step}: not a complete checkpoint (no checkpoint.json; an interrupted save?)"
    with open(os.path.join(directory, "latest"), "w") as f:
        f.write("garbage\n")
    assert _fails(directory) == f"{directory}/latest: expected a step number, found 'garbage'"


def test_another_spec_or_other_shapes(saved):
    directory, step = saved
    llama = specc_torch.build_model(LLAMA, seed=1)
    message = _fails(directory, llama)
    assert message.startswith(f"{step}: saved from spec gpt_tiny (sha256 ")
    assert "but this model is spec llama_tiny (sha256 " in message

    # names and shapes are checked even where the spec check is waived
    message = _fails(directory, llama, allow_spec_change=True)
    assert message.startswith(f"{step}: the checkpoint does not match this model: ")
    assert "parameter(s) of this model are not in the checkpoint: layers.0.input_norm.weight" in message
    assert "parameter(s) in the checkpoint are not in this model: position_embedding.weight" in message

    wider = specc_torch.build_model(GPT, seed=1, overrides={"hidden_size": 128})
    assert "saved from spec gpt_tiny" in _fails(directory, wider)  # --set changes the spec's hash
    message = _fails(directory, wider, allow_spec_change=True)
    assert message.startswith(f"{step}: the checkpoint does not match this model: shapes differ: "
                              f"embedding.weight is [256, 64] in the checkpoint, [256, 128] in this model")


def test_optimizer_state_that_does_not_match(saved):
    directory, step = saved
    model = specc_torch.build_model(GPT, seed=2)
    m = torch.zeros_like(model.embedding.weight)
    assert _fails(directory, model, optimizer_state={"step": 0, "v": {"embedding.weight": ParamShard(
        "embedding.weight", m)}}) == f"{step}: the checkpoint has no optimizer state v/embedding.weight"
    assert _fails(directory, model, optimizer_state={"epoch": 0}) == (
        f"{step}: the checkpoint's optimizer state has no value at epoch")
    out = load_checkpoint(directory, model, optimizer_state={"step": 0, "m": {"embedding.weight": ParamShard(
        "embedding.weight", m)}})
    assert out["optimizer_state"]["step"] == 7 and bool((m == 1).all())


def test_a_model_only_checkpoint_has_no_optimizer_state(tmp_path):
    model = specc_torch.build_model(GPT, seed=1)
    save_checkpoint(str(tmp_path), 1, model)
    assert load_checkpoint(str(tmp_path), model)["optimizer_state"] is None
    message = _fails(str(tmp_path), model, optimizer_state={"step": 0})
    assert message == f"{tmp_path}/step_0000001: the checkpoint has no optimizer state (load the model only: pass no optimizer_state)"


def test_save_time_mistakes(tmp_path):
    model = specc_torch.build_model(GPT, seed=1)
    with pytest.raises(ValueError, match="ParamShard names parameter 'nope', which the model does not have"):
        save_checkpoint(str(tmp_path), 1, model, optimizer_state={"x": ParamShard("nope", torch.zeros(3))})
    with pytest.raises(ValueError, match="data_state at when is of type object; checkpoints hold tensors"):
        save_checkpoint(str(tmp_path), 1, model, data_state={"when": object()})
    with pytest.raises(ValueError, match=r"flat range \[4090, 4100\) is outside the shard's 4096 elements"):
        save_checkpoint(str(tmp_path), 1, model, optimizer_state={"x": ParamShard(
            "layers.0.self_attention.linear_proj.weight", torch.zeros(10), start=4090)})
    assert not os.path.exists(tmp_path / "latest")


def _save_rank_dependent(rank, world, directory, what):
    pg = ProcessGroups.initialize(tp=1)  # DP=2
    try:
        model = specc_torch.build_model(GPT, pg, seed=1)
        if what == "data":
            save_checkpoint(directory, 1, model, pg, data_state={"consumed_samples": rank})
        elif what == "rank_local":
            save_checkpoint(directory, 1, model, pg, optimizer_state={
                "step": 1, "mine": RankLocal(rank), "flat": torch.full((3,), float(rank))})
        return None
    except ValueError as e:
        return str(e)
    finally:
        pg.destroy()


def _load_rank_local(rank, world, directory):
    pg = ProcessGroups.initialize(tp=1)
    try:
        model = specc_torch.build_model(GPT, pg, seed=2)
        flat = torch.zeros(3)
        out = load_checkpoint(directory, model, pg, optimizer_state={"step": 0, "mine": RankLocal(None), "flat": flat})
        return out["optimizer_state"]["mine"].value, flat.tolist(), out["rng_restored"]
    finally:
        pg.destroy()


def test_replicated_and_rank_local_values_across_ranks(gloo, tmp_path):
    directory = str(tmp_path / "ckpt")
    messages = gloo.run(2, _save_rank_dependent, directory, "data")
    assert messages[0] == messages[1] == ("data_state differ between rank 0 and rank 1; replicated values must be "
                                          "the same on every rank (wrap a per-rank value in RankLocal)")
    assert gloo.run(2, _save_rank_dependent, directory, "rank_local") == [None, None]
    # the same layout restores each rank's own values ...
    assert gloo.run(2, _load_rank_local, directory) == [(0, [0.0] * 3, True), (1, [1.0] * 3, True)]
    # ... another layout cannot: rank-local state is refused, by name
    model = specc_torch.build_model(GPT, seed=2)
    message = _fails(directory, model, optimizer_state={"step": 0, "mine": RankLocal(None)})
    assert message == (f"{directory}/step_0000001: optimizer state mine is rank-local, saved at tp=1 cp=1 dp=2 pp=1; "
                       f"it cannot be loaded at tp=1 cp=1 dp=1 pp=1 (give per-parameter tensors as ParamShard to "
                       f"reshard them)")
    info = json.load(open(os.path.join(directory, "step_0000001", "checkpoint.json")))
    assert info["layout"]["dp"] == 2


def test_latest_that_is_a_directory_or_binary(saved):
    directory, step = saved
    latest = os.path.join(directory, "latest")
    with open(latest, "wb") as f:
        f.write(b"\x00\xff\xfe7\n")
    assert _fails(directory) == f"{latest}: expected a step number, found '\\x00\\ufffd\\ufffd7'"
    with open(latest, "w") as f:
        f.write("\u00b2\n")  # a digit to str.isdigit, not to int()
    assert _fails(directory) == f"{latest}: expected a step number, found '\\xb2'"
    with open(latest, "w") as f:
        f.write("9" * 5000 + "\n")  # no step: the error line quotes 40 digits, not a 5000-digit directory name
    assert _fails(directory) == f"{latest}: expected a step number, found '{'9' * 40}'..."
    os.remove(latest)
    os.makedirs(latest)
    assert _fails(directory) == f"{latest}: is a directory, not the file naming the latest step"
    with pytest.raises(CheckpointError, match="is a directory, not the file naming the latest step"):
        read_tensors(directory)
    assert load_checkpoint(step, specc_torch.build_model(GPT, seed=2))["step"] == 7  # the step itself still loads


@pytest.mark.parametrize("edit,problem", [
    (lambda i: i.pop("params"), "no 'params'"),
    (lambda i: i.pop("files"), "no 'files'"),
    (lambda i: i.update(step=-1), "'step' must be a non-negative integer, found -1"),
    (lambda i: i.update(step=True), "'step' must be a non-negative integer, found true"),
    (lambda i: i.update(spec="gpt_tiny"), "'spec' must be an object with string 'name' and 'sha256', found \"gpt_tiny\""),
    (lambda i: i["layout"].pop("dp"), "'layout' must be an object with positive integers 'tp', 'cp', 'dp', 'pp'"),
    (lambda i: i.update(optimizer=[]), "'optimizer' must be null or an object, found []"),
    (lambda i: i.update(rng="yes"), "'rng' must be true or false, found \"yes\""),
    (lambda i: i["params"]["embedding.weight"].update(shape=[256, "64"]), "parameter 'embedding.weight' must have a "
     "'shape' (a list of sizes) and a torch 'dtype', found {\"shape\": [256, \"64\"]"),
    (lambda i: i["params"]["embedding.weight"].update(dtype="float99"), "parameter 'embedding.weight' must have a "),
    (lambda i: i["files"]["__0_0.distcp"].update(bytes="12"), "file '__0_0.distcp' must have 'bytes' (an integer) "
     "and 'crc32' (a string), found {\"bytes\": \"12\""),
    (lambda i: i["files"].update({"../step_0000007/.metadata": {"bytes": 1, "crc32": "0"}}),
     "file name '../step_0000007/.metadata' is not a plain file name"),
    (lambda i: i["optimizer"]["sharded"].update({"m/x": {"shape": None}}), "optimizer state 'm/x' must have a 'shape' "
     "(a list of sizes), found {\"shape\": null}"),
])
def test_checkpoint_json_that_lacks_or_mistypes_fields(saved, edit, problem):
    directory, step = saved
    path = os.path.join(step, "checkpoint.json")
    info = json.load(open(path))
    edit(info)
    with open(path, "w") as f:
        json.dump(info, f)
    message = _fails(directory)
    assert message.startswith(f"{step}: checkpoint.json is corrupt: {problem}"), message
    with pytest.raises(CheckpointError) as e:
        read_tensors(directory)
    assert str(e.value) == message
