"""specc_torch.build_model compiles a spec in memory; runtime.build_model, which needs no
compiler, takes only a generated folder and sends a spec file to specc_torch."""

from __future__ import annotations

import os

import pytest
import torch

import runtime
import specc_torch
from specc_cli.main import main

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
GPT_TINY = os.path.join(ROOT, "specs", "gpt-tiny.yaml")


def test_a_spec_in_memory_and_its_generated_folder_build_the_same_model(tmp_path):
    assert main(["compile", GPT_TINY, "-o", str(tmp_path), "--name", "gpt_tiny"]) == 0
    folder = str(tmp_path / "gpt_tiny")
    from_spec = specc_torch.build_model(GPT_TINY, seed=5).state_dict()
    for model in (runtime.build_model(folder, seed=5), specc_torch.build_model(folder, seed=5)):
        state = model.state_dict()
        assert list(state) == list(from_spec)
        assert all(torch.equal(state[k], from_spec[k]) for k in state)


@pytest.mark.parametrize("name", ["gpt-tiny.yaml", "missing.yml"])
def test_runtime_build_model_sends_a_spec_file_to_specc_torch(name):
    with pytest.raises(ValueError, match=r"use specc_torch\.build_model\("):
        runtime.build_model(os.path.join(ROOT, "specs", name))


def test_runtime_build_model_of_a_missing_folder_says_so(tmp_path):
    with pytest.raises(FileNotFoundError, match="no such generated directory"):
        runtime.build_model(str(tmp_path / "nothing"))
