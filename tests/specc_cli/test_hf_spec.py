"""The `hf:` block of a spec is checked when the spec loads (`specc validate`): every mistake in its
structure is one located error, without torch."""

from __future__ import annotations

import os

import pytest

from specc.errors import SpecError
from specc.frontend.load import load_spec

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _load(tmp_path, hf_text: str):
    parent = os.path.relpath(os.path.join(ROOT, "specs", "gpt-tiny.yaml"), tmp_path)
    path = tmp_path / "child.yaml"
    path.write_text(f"name: child\nextends: {parent}\nhf:\n{hf_text}")
    return load_spec(str(path))


def _error(tmp_path, hf_text: str) -> str:
    with pytest.raises(SpecError) as e:
        _load(tmp_path, hf_text)
    return e.value.format()


def test_the_shipped_mappings_load_and_are_inherited(tmp_path):
    spec = _load(tmp_path, "  architecture: GPT2LMHeadModel\n")
    assert spec.hf["architecture"] == "GPT2LMHeadModel"
    assert len(spec.hf["params"]) == 16 and spec.hf["params"][4]["transpose"] is True  # from gpt.yaml
    llama = load_spec(os.path.join(ROOT, "specs", "llama-tiny.yaml"))
    assert llama.hf["params"][2]["hf"][1] == "model.layers.{i}.self_attn.k_proj.weight"


@pytest.mark.parametrize("hf_text, expected", [
    ("  5\n", "child.yaml:4:3: error: 'hf' must be a mapping, got an integer (e.g. hf: {architecture: ..., "
     "params: [...]})"),
    ("  archtecture: X\n", "child.yaml:4:3: error: unknown key 'archtecture' in 'hf' (did you mean 'architecture'?)"),
    ("  architecture: [X]\n", "child.yaml:4:17: error: 'architecture' must be a string, got a list (the Hugging "
     "Face class, e.g. LlamaForCausalLM)"),
    ("  config: {n_head: '${num_heads}'}\n",
     "child.yaml:4:23: error: undefined interpolation variable 'num_heads' (did you mean 'num_attention_heads'?)"),
    ("  config: [1]\n", "child.yaml:4:11: error: 'config' must be a mapping of Hugging Face config keys, got a list"),
    ("  rotary: {layout: sideways}\n",
     "child.yaml:4:20: error: 'rotary.layout' must be one of rotate_half, interleaved, got 'sideways' (how the "
     "Hugging Face q/k weights order each head's rotary pairs)"),
    ("  rotary: {layout: interleaved}\n",
     "child.yaml:4:11: error: 'rotary.head_dim' must be an even integer, got nothing (null) (e.g. head_dim: "
     "${head_dim})"),
    ("  params: {a: b}\n", "child.yaml:4:11: error: 'params' must be a list, got a mapping (one entry per "
     "parameter: - {specc: NAME, hf: HF_NAME})"),
    ("  params: [{specc: a}]\n", "child.yaml:4:12: error: 'hf.params' entry is missing 'hf' (e.g. - {specc: "
     "embedding.weight, hf: model.embed_tokens.weight})"),
    ("  params: [{specc: a, hf: b, flip: true}]\n",
     "child.yaml:4:30: error: unknown key 'flip' in an 'hf.params' entry (expected one of: hf, permute, rotary, "
     "specc, transpose)"),
    ("  params: [{specc: a, hf: b, permute: {groups: 2}}]\n",
     "child.yaml:4:39: error: 'permute' is missing 'sections' (e.g. permute: {groups: ${num_attention_heads}, "
     "sections: [${head_dim}, ${head_dim}, ${head_dim}]})"),
    ("  params: [{specc: a, hf: b, permute: {groups: 2, sections: [4, x]}}]\n",
     "child.yaml:4:61: error: 'permute.sections' must be a non-empty list of positive integers, got [4, 'x'] "
     "(e.g. permute: {groups: ${num_attention_heads}, sections: [${head_dim}, ${head_dim}, ${head_dim}]})"),
    ("  params: [{specc: 'layers.{j}.w', hf: b}]\n",
     "child.yaml:4:20: error: the specc name 'layers.{j}.w' has a placeholder other than {i} ({i} stands for a "
     "layer index, e.g. layers.{i}.mlp.linear_fc1.weight)"),
    ("  params: [{specc: 'layers.{i}.w', hf: b}]\n",
     "child.yaml:4:40: error: 'b' and 'layers.{i}.w' must both have {i} or neither ({i} is the layer index on "
     "both sides)"),
    ("  params: [{specc: a, hf: []}]\n", "child.yaml:4:27: error: 'hf' must name at least one tensor"),
    ("  params: [{specc: a, hf: [x, y], rotary: [true]}]\n",
     "child.yaml:4:43: error: 'rotary' must be true/false, or a list of true/false with one per 'hf' name (which "
     "tensors hold rotary q/k heads)"),
    ("  params: [{specc: a, hf: x, transpose: 1}]\n",
     "child.yaml:4:41: error: 'transpose' must be true or false, got an integer"),
    ("  params: [{specc: a, hf: x}, {specc: a, hf: y}]\n", "child.yaml:4:39: error: 'a' is mapped twice"),
    ("  ignore: x\n", "child.yaml:4:11: error: 'ignore' must be a list of names, got a string"),
    ("  ignore: [3]\n", "child.yaml:4:12: error: an ignored name must be a non-empty string, got an integer"),
])
def test_mistakes_are_located(tmp_path, hf_text, expected):
    message = _error(tmp_path, hf_text)
    assert message == f"{tmp_path}/{expected}"
    assert "\n" not in message
