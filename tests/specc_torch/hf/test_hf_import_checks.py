"""What `specc hf import` refuses in the tensors it reads, each in one line naming the file and
the tensor, with nothing written (issue 23): NaN or infinite values (counted), integer or bool
dtypes, float8 (quantized) formats."""

from __future__ import annotations

import os
import shutil

import pytest
import torch
from hf_helpers import SPECS, save_hf
from safetensors.torch import load_file, save_file

from specc import cli
from specc_torch.hf import HFError, import_hf

pytest.importorskip("transformers")

INDEX = "model.safetensors.index.json"
EMB, NORM = "model.embed_tokens.weight", "model.norm.weight"


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    directory = tmp_path_factory.mktemp("base") / "llama"
    save_hf("llama", str(directory))
    return directory


@pytest.fixture
def hf(base, tmp_path):
    """A fresh copy of a random tiny Llama (config.json + model.safetensors) for specs/llama-tiny.yaml."""
    directory = tmp_path / "hf"
    shutil.copytree(base, directory)
    return directory


def _weights(hf_dir) -> dict:
    return load_file(str(hf_dir / "model.safetensors"))


def _put(hf_dir, tensors: dict, name: str = "model.safetensors") -> None:
    save_file(tensors, str(hf_dir / name), metadata={"format": "pt"})


def _refused(hf_dir, tmp_path) -> str:
    """import's error: one line, and nothing written."""
    out = tmp_path / "ckpt"
    with pytest.raises(HFError) as e:
        import_hf(str(hf_dir), SPECS["llama"], str(out))
    assert not os.path.exists(out)
    assert "\n" not in str(e.value)
    return str(e.value)


def _cli(hf_dir, tmp_path, capfd):
    """(exit code, stderr) of `specc hf import` run as the command line runs it."""
    code = cli.main(["hf", "import", str(hf_dir), "--spec", SPECS["llama"], "--out", str(tmp_path / "cli-ckpt")])
    out, err = capfd.readouterr()
    assert out == "" and not os.path.exists(tmp_path / "cli-ckpt")
    return code, err


# -- tensors -------------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_non_finite_weights_are_refused_with_their_count(hf, tmp_path, dtype):
    weights = {k: v.to(dtype) for k, v in _weights(hf).items()}
    norm = weights[NORM].clone()
    norm[3] = float("nan")
    _put(hf, {**weights, NORM: norm})
    assert _refused(hf, tmp_path) == (f"{hf}/model.safetensors: {NORM} has 1 of its 64 values not finite (1 NaN, "
                                      f"0 infinite); weights must be finite")
    emb = weights[EMB].clone()
    emb[5, :3] = float("inf")
    emb[7, 1] = float("-inf")
    emb[9, 2] = float("nan")
    _put(hf, {**weights, EMB: emb})
    assert _refused(hf, tmp_path) == (f"{hf}/model.safetensors: {EMB} has 5 of its 16,384 values not finite "
                                      f"(1 NaN, 4 infinite); weights must be finite")


def test_integer_and_bool_weights_are_refused(hf, tmp_path, capfd):
    weights = _weights(hf)
    for dtype, name in ((torch.int64, EMB), (torch.int32, NORM), (torch.uint8, NORM), (torch.bool, NORM)):
        _put(hf, {**weights, name: weights[name].to(dtype)})
        shown = str(dtype).replace("torch.", "")
        assert _refused(hf, tmp_path) == (f"{hf}/model.safetensors: {name} has dtype {shown}, but weights are "
                                          f"floating point (float32, bfloat16, float16 or float64)")
    assert _cli(hf, tmp_path, capfd) == (2, f"{hf}/model.safetensors: error: {NORM} has dtype bool, but weights are "
                                            f"floating point (float32, bfloat16, float16 or float64)\n")


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_float8_weights_are_refused(hf, tmp_path, dtype):
    weights = _weights(hf)
    _put(hf, {**weights, EMB: weights[EMB].to(dtype)})
    shown = str(dtype).replace("torch.", "")
    assert _refused(hf, tmp_path) == (f"{hf}/model.safetensors: {EMB} is {shown}, a quantized format import does "
                                      f"not read (dequantize the checkpoint to bf16 or fp32 first, applying its "
                                      f"scales)")
