"""What a checkpoint holds is what its metadata says, or it does not load: every file that holds
saved data is listed in checkpoint.json (and so checked), and the step agrees everywhere it is
written (the directory's name, which `latest` names, checkpoint.json, and the saved data)."""

from __future__ import annotations

import json
import os
import zlib

import pytest
import torch
from ckpt_helpers import GPT

import specc_torch
from runtime.checkpoint import CheckpointError, load_checkpoint, read_tensors, save_checkpoint


@pytest.fixture
def saved(tmp_path):
    directory = str(tmp_path / "ckpt")
    model = specc_torch.build_model(GPT, seed=1)
    save_checkpoint(directory, 7, model, scheduler_state={"iteration": 7}, data_state={"consumed_samples": 28})
    return directory, os.path.join(directory, "step_0000007"), model


def _edit_info(step_dir: str, edit) -> None:
    path = os.path.join(step_dir, "checkpoint.json")
    with open(path) as f:
        info = json.load(f)
    edit(info)
    with open(path, "w") as f:
        json.dump(info, f)


def _refused(directory: str) -> str:
    """load_checkpoint and read_tensors both refuse it with the same one line; the model is untouched."""
    model = specc_torch.build_model(GPT, seed=2)
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(CheckpointError) as e:
        load_checkpoint(directory, model)
    assert all(torch.equal(a, p) for a, p in zip(before, model.parameters()))
    message = str(e.value)
    assert "\n" not in message
    with pytest.raises(CheckpointError) as again:
        read_tensors(directory)
    assert str(again.value) == message
    return message


def test_a_shard_dropped_from_the_file_list_is_refused(saved):
    directory, step_dir, _ = saved
    _edit_info(step_dir, lambda info: info["files"].pop("__0_0.distcp"))
    assert _refused(directory) == (f"{step_dir}: file __0_0.distcp holds saved data (.metadata places blocks in it) "
                                   f"but is not listed in checkpoint.json, so it cannot be checked (an edited "
                                   f"checkpoint.json?)")


def test_metadata_dropped_from_the_file_list_is_refused(saved):
    directory, step_dir, _ = saved
    _edit_info(step_dir, lambda info: info["files"].pop(".metadata"))
    assert _refused(directory) == (f"{step_dir}: file .metadata is not listed in checkpoint.json (an edited "
                                   f"checkpoint.json?): it cannot be checked")


def test_a_shard_cut_short_with_its_listing_edited_to_match_is_refused(saved):
    """Size and crc32 listed for what is there, but less than .metadata places in the file."""
    directory, step_dir, _ = saved
    shard = os.path.join(step_dir, "__0_0.distcp")
    data = open(shard, "rb").read()
    cut = data[: len(data) // 2]
    with open(shard, "wb") as f:
        f.write(cut)
    _edit_info(step_dir, lambda info: info["files"].update(
        {"__0_0.distcp": {"bytes": len(cut), "crc32": f"{zlib.crc32(cut):08x}"}}))
    message = _refused(directory)
    assert message.startswith(f"{step_dir}: file __0_0.distcp is listed with {len(cut)} bytes, but .metadata places "
                              f"data up to byte "), message


def test_a_hand_edited_step_is_refused(saved):
    directory, step_dir, _ = saved
    _edit_info(step_dir, lambda info: info.update(step=9))
    assert _refused(directory) == (f"{step_dir}: checkpoint.json says step 9, but the checkpoint is step 7 (its "
                                   f"directory's name); an edited or misplaced checkpoint.json?")


def test_rng_states_hidden_by_a_hand_edited_flag_are_refused(saved):
    """checkpoint.json edited to say it holds no RNG states: the load read none and went on from
    streams seeded afresh, not the run it continues, without a word (--no-load-rng, which loading
    does not implement, by hand). The weights alone (read_tensors) still read."""
    directory, step_dir, model = saved
    _edit_info(step_dir, lambda info: info.update(rng=False))
    other = specc_torch.build_model(GPT, seed=2)
    before = [p.detach().clone() for p in other.parameters()]
    with pytest.raises(CheckpointError) as e:
        load_checkpoint(directory, other)
    assert str(e.value) == (f"{step_dir}: the saved data holds this rank's RNG states, but checkpoint.json says it "
                            f"has none (an edited checkpoint.json?)")
    assert all(torch.equal(a, p) for a, p in zip(before, other.parameters()))
    assert read_tensors(directory).keys() == dict(model.named_parameters()).keys()


def test_a_checkpoint_renamed_to_another_step_everywhere_but_in_its_data_is_refused(saved, tmp_path):
    """The directory, `latest` and checkpoint.json all say 9: the saved data still says 7."""
    directory, step_dir, _ = saved
    _edit_info(step_dir, lambda info: info.update(step=9))
    renamed = os.path.join(directory, "step_0000009")
    os.rename(step_dir, renamed)
    with open(os.path.join(directory, "latest"), "w") as f:
        f.write("9\n")
    assert _refused(directory) == (f"{renamed}: the saved data is of step 7, but checkpoint.json says step 9 (an "
                                   f"edited checkpoint.json?)")
    # a copy under a name that is no step: its checkpoint.json and its data still disagree
    copy = str(tmp_path / "mine")
    os.rename(renamed, copy)
    assert _refused(copy) == f"{copy}: the saved data is of step 7, but checkpoint.json says step 9 (an edited " \
                             f"checkpoint.json?)"


def test_an_untouched_checkpoint_still_loads_everywhere(saved, tmp_path):
    directory, step_dir, model = saved
    other = specc_torch.build_model(GPT, seed=2)
    out = load_checkpoint(directory, other)
    assert out["step"] == 7 and out["scheduler_state"] == {"iteration": 7}
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), other.parameters()))
    assert load_checkpoint(step_dir, other)["step"] == 7  # the step directory itself
    copy = str(tmp_path / "copy")
    os.rename(step_dir, copy)  # under any name
    assert load_checkpoint(copy, other)["step"] == 7
    assert read_tensors(copy).keys() == dict(model.named_parameters()).keys()
