"""`specc hf import` then `specc hf export` from the command line: the round trip is bit-exact,
the import loads into the compiled spec, and every user mistake is one line with exit code 2."""

from __future__ import annotations

import os
import sys

import pytest

pytest.importorskip("transformers")
torch = pytest.importorskip("torch")

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "tests", "specc_torch", "hf"))
from hf_helpers import SPECS, save_hf  # noqa: E402


def test_import_then_export_round_trips_bit_exactly(specc, tmp_path):
    from safetensors.torch import load_file

    hf_dir, ckpt, out = tmp_path / "hf", tmp_path / "ckpt", tmp_path / "out"
    save_hf("llama", str(hf_dir), seed=4)
    code, stdout, stderr = specc("hf", "import", hf_dir, "--spec", SPECS["llama"], "--out", ckpt)
    assert (code, stderr) == (0, ""), stderr
    assert stdout == (f"specc hf import: {hf_dir} (LlamaForCausalLM, 21 tensors, 94,528 parameters) -> "
                      f"{ckpt}/step_0000000 (spec llama_tiny)\n")
    assert sorted(os.listdir(ckpt)) == ["latest", "run.lock", "step_0000000"]

    code, stdout, stderr = specc("hf", "export", ckpt, "--spec", SPECS["llama"], "--out", out)
    assert (code, stderr) == (0, ""), stderr
    assert stdout.startswith(f"specc hf export: {ckpt} (step 0, spec llama_tiny) -> {out} (LlamaForCausalLM, ")
    original, exported = load_file(str(hf_dir / "model.safetensors")), load_file(str(out / "model.safetensors"))
    assert sorted(original) == sorted(exported)
    assert all(torch.equal(original[k], exported[k]) and original[k].dtype == exported[k].dtype for k in original)
    assert sorted(os.listdir(out)) == ["config.json", "model.safetensors"]


def test_overrides_compile_the_spec_to_the_model_at_hand(specc, tmp_path):
    hf_dir = tmp_path / "hf"
    save_hf("gpt", str(hf_dir), n_layer=3)
    code, _, stderr = specc("hf", "import", hf_dir, "--spec", SPECS["gpt"], "--out", tmp_path / "a")
    assert code == 2 and stderr == f"{hf_dir}: error: config.json has n_layer = 3, but spec gpt_tiny gives 2\n"
    code, stdout, stderr = specc("hf", "import", hf_dir, "--spec", SPECS["gpt"], "--set", "num_layers=3",
                                 "--out", tmp_path / "b")
    assert code == 0, stderr
    # the checkpoint remembers the overridden spec: exporting it needs the same --set
    code, _, stderr = specc("hf", "export", tmp_path / "b", "--spec", SPECS["gpt"], "--out", tmp_path / "c")
    assert code == 2 and "saved from spec gpt_tiny (sha256 " in stderr and stderr.count("\n") == 1
    code, _, stderr = specc("hf", "export", tmp_path / "b", "--spec", SPECS["gpt"], "--set", "num_layers=3",
                            "--out", tmp_path / "c")
    assert code == 0, stderr


def test_user_mistakes_are_one_line(specc, tmp_path):
    cases = [
        (("hf", "import", tmp_path / "none", "--spec", SPECS["gpt"], "--out", tmp_path / "x"),
         f"{tmp_path}/none: error: no config.json\n"),
        (("hf", "export", tmp_path / "none", "--spec", SPECS["gpt"], "--out", tmp_path / "x"),
         f"{tmp_path}/none: error: no such directory\n"),
        (("hf", "import", tmp_path, "--spec", SPECS["gpt"], "--set", "num_layer=3", "--out", tmp_path / "x"),
         "--set num_layer=3: error: unknown config value 'num_layer' (did you mean 'num_layers'?)\n"),
    ]
    for argv, expected in cases:
        code, stdout, stderr = specc(*argv)
        assert (code, stdout, stderr) == (2, "", expected), argv
    spec = os.path.join(ROOT, "specs", "parallel-block-tiny.yaml")
    code, _, stderr = specc("hf", "import", tmp_path, "--spec", spec, "--out", tmp_path / "x")
    assert code == 2 and stderr.startswith(f"{os.path.join(ROOT, 'specs', 'gpt.yaml')}:")
    assert "error: 'layers.{i}.self_attention.linear_qkv.bias' matches no parameter of model parallel_block_tiny" in stderr
    assert not os.path.exists(tmp_path / "x")
