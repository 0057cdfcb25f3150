"""The shipped families against their Hugging Face implementations (random models built from
tiny configs, no download): `specc hf import`, then the compiled tiny spec's logits equal
transformers' to 1e-4 at TP 1, 2 and 4 with and without SP, in one 4-rank gloo world; import then
export gives back every tensor bit for bit; a config asking for behaviour the spec's ops do not
model is refused in one line."""

from __future__ import annotations

import os

import pytest
import torch
from families import FAMILIES, hf_logits, hf_model, inputs, parity, real, specc_logits
from safetensors.torch import load_file

import specc_torch
from runtime.checkpoint import load_checkpoint
from runtime.parallel_state import ProcessGroups
from specc_torch.hf import HFError, export_hf, import_hf
from specc_torch.hf.checks import check_modeled
from specc_torch.hf.convert import model_params
from specc_torch.hf.layouts import grouped_to_sections, sections_to_grouped

pytest.importorskip("transformers")
TOL = 1e-4
NAMES = {"bert": ["tokens", "token_types", "attention_mask", "labels"]}


@pytest.fixture(scope="module")
def imported(tmp_path_factory):
    """family -> (HF directory, imported checkpoint, (HF output-layer logits, per-token loss))."""
    from transformers.utils import logging

    logging.disable_progress_bar()
    root = tmp_path_factory.mktemp("families")
    out, batch = {}, inputs()
    for family, spec in FAMILIES.items():
        model = hf_model(family)
        hf_dir, ckpt = str(root / family / "hf"), str(root / family / "ckpt")
        model.save_pretrained(hf_dir)
        done = import_hf(hf_dir, spec, ckpt)
        assert done["parameters"] == sum(p.numel() for p in model.parameters())  # a tied weight counts once
        out[family] = (hf_dir, ckpt, hf_logits(model, batch))
    return out


def test_logits_match_transformers_at_tp_1_2_4_with_and_without_sp(gloo, imported):
    batch = inputs()
    cases = [(f, FAMILIES[f], imported[f][1], NAMES.get(f, ["tokens", "labels"]), batch) for f in FAMILIES]
    results = gloo.run(4, parity, cases)[0]
    seen = set()
    for family, tp, sp, logits, loss in results:
        expected, expected_loss = imported[family][2]
        keep = real(batch, family)
        err = (logits - expected)[keep].abs().max().item()
        assert err < TOL, f"{family} tp={tp} sp={sp}: max |specc - transformers| = {err:.2e}"
        # the loss reads the logits after what follows the output layer (Gemma 2's soft cap)
        err = (loss - expected_loss)[keep].abs().max().item()
        assert err < TOL, f"{family} tp={tp} sp={sp}: per-token loss, max |specc - transformers| = {err:.2e}"
        seen.add((family, tp, sp))
    assert len(seen) == len(FAMILIES) * 5  # tp 1; tp 2 and 4, each with and without SP


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_import_then_export_round_trips_bit_exactly(imported, tmp_path, family):
    hf_dir, ckpt, _ = imported[family]
    export_hf(ckpt, FAMILIES[family], str(tmp_path / "out"))
    original = load_file(os.path.join(hf_dir, "model.safetensors"))
    exported = load_file(str(tmp_path / "out" / "model.safetensors"))
    ignored = {k for k in original if k not in exported}
    assert all(k.endswith(("position_ids", "token_type_ids", "inv_freq")) for k in ignored), ignored
    for name, t in exported.items():
        assert torch.equal(original[name], t), name


def test_exported_models_load_in_transformers(imported, tmp_path):
    """GPT-NeoX (rows permuted back per head), BERT (tied decoder and bias) and Gemma 2 (its
    window, layer types, score scale and caps written back into config.json) from specc's checkpoint."""
    from transformers import AutoModelForCausalLM, AutoModelForMaskedLM

    batch = inputs()
    for family, auto in (("gpt-neox", AutoModelForCausalLM), ("bert", AutoModelForMaskedLM),
                         ("gemma2", AutoModelForCausalLM)):
        out = str(tmp_path / family)
        export_hf(imported[family][1], FAMILIES[family], out)
        model = auto.from_pretrained(out, attn_implementation="eager").eval()
        keep = real(batch, family)
        for got, want in zip(hf_logits(model, batch), imported[family][2]):
            assert (got - want)[keep].abs().max().item() < TOL, family


def test_the_per_head_permutation():
    """GPT-NeoX's fused QKV rows [q0 k0 v0 q1 k1 v1] become [q0 q1 | k0 k1 | v0 v1], and back."""
    rows = torch.arange(12.0)[:, None].expand(12, 3)  # 2 heads, head_dim 2: q0=0,1 k0=2,3 v0=4,5 q1=6,7...
    specc = grouped_to_sections(rows, 2, (2, 2, 2))
    assert specc[:, 0].tolist() == [0, 1, 6, 7, 2, 3, 8, 9, 4, 5, 10, 11]
    assert torch.equal(sections_to_grouped(specc, 2, (2, 2, 2)), rows)
    grouped = grouped_to_sections(torch.arange(8.0), 2, (2, 1, 1))  # grouped-query: 2 q heads per group
    assert grouped.tolist() == [0, 1, 4, 5, 2, 6, 3, 7]


def _refused(tmp_path, family: str, spec: str, **changes) -> str:
    from transformers.utils import logging

    logging.disable_progress_bar()
    import families

    config = families.hf_config(family)
    for k, v in changes.items():
        setattr(config, k, v)
    hf_dir = str(tmp_path / "hf")
    from transformers import AutoModelForCausalLM

    AutoModelForCausalLM.from_config(config).save_pretrained(hf_dir)
    with pytest.raises(HFError) as e:
        import_hf(hf_dir, spec, str(tmp_path / "ckpt"))
    assert not os.path.exists(tmp_path / "ckpt")
    return str(e.value)


def test_configs_the_ops_do_not_model_are_refused(tmp_path):
    """The ops' own knowledge, not keys the spec lists: qwen2.yaml names no sliding_window, llama's
    mapping no partial rotary factor, mistral's none that is null, and none of them ties."""
    llama_tiny = os.path.join(os.path.dirname(FAMILIES["llama3"]), "llama-tiny.yaml")
    assert _refused(tmp_path / "a", "qwen2", FAMILIES["qwen2"], use_sliding_window=True, sliding_window=8,
                    layer_types=["sliding_attention", "sliding_attention"]) == (
        f"{tmp_path}/a/hf: config.json asks for sliding_window = 8, but spec qwen2_tiny models none at "
        "layers.0.self_attention.core_attention (core_attention)")
    # a checkpoint without the window the spec has (its listed sliding_window is null, so not checked)
    assert _refused(tmp_path / "b", "mistral", FAMILIES["mistral"], sliding_window=None) == (
        f"{tmp_path}/b/hf: config.json asks for sliding_window = none, but spec mistral_tiny models 5 at "
        "layers.0.self_attention.core_attention (core_attention)")
    partial = dict(rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5},
                   num_key_value_heads=4)
    assert _refused(tmp_path / "c", "llama3", llama_tiny, **partial) == (
        f"{tmp_path}/c/hf: config.json asks for partial_rotary_factor = 0.5, but spec llama_tiny models 1.0 at "
        "layers.0.self_attention.rotary (rotary)")
    # the knob alone, as a spec that lists no tie_word_embeddings meets it
    graph = model_params(FAMILIES["mistral"], with_graph=True)[3]
    with pytest.raises(HFError) as e:
        check_modeled(graph, {"tie_word_embeddings": True}, "x", "mistral_tiny")
    assert str(e.value) == "x: config.json asks for tie_word_embeddings = true, but spec mistral_tiny's linear ops model false"
    check_modeled(graph, {"tie_word_embeddings": False, "sliding_window": 5, "rope_theta": 10000.0}, "x", "mistral_tiny")
    # Gemma 2: the layer types must be the spec's cycled window pattern, its caps the spec's
    gemma2 = model_params(FAMILIES["gemma2"], with_graph=True)[3]
    alternating = ["sliding_attention", "full_attention", "sliding_attention"]
    asked = {"sliding_window": 4, "layer_types": alternating, "attn_logit_softcapping": 1.0,
             "final_logit_softcapping": 2.0, "query_pre_attn_scalar": 8}
    check_modeled(gemma2, asked, "x", "gemma2_tiny")
    for change, message in [
        ({"layer_types": ["sliding_attention"] * 3}, "sliding_window = 4, but spec gemma2_tiny models none at layers.1"),
        ({"layer_types": ["full_attention", "sliding_attention", "full_attention"]},
         "sliding_window = none, but spec gemma2_tiny models 4 at layers.0"),
        ({"layer_types": alternating[:2] + ["linear_attention"]},
         'sliding_window = "linear_attention", but spec gemma2_tiny models 4 at layers.2'),
        ({"attn_logit_softcapping": None}, "attn_logit_softcapping = none, but spec gemma2_tiny models 1.0 at layers.0"),
        ({"query_pre_attn_scalar": 16}, "query_pre_attn_scalar = 0.25, but spec gemma2_tiny models 0.3535"),
        ({"final_logit_softcapping": 30.0}, "final_logit_softcapping = 30.0, but spec gemma2_tiny's softcap ops model 2.0"),
    ]:
        with pytest.raises(HFError) as e:
            check_modeled(gemma2, {**asked, **change}, "x", "gemma2_tiny")
        assert str(e.value).startswith(f"x: config.json asks for {message}"), str(e.value)
    with pytest.raises(HFError) as e:  # a Gemma 2 cap on a spec without a soft cap
        check_modeled(graph, {"final_logit_softcapping": 30.0}, "x", "mistral_tiny")
    assert str(e.value) == "x: config.json asks for final_logit_softcapping = 30.0, but spec mistral_tiny's softcap ops model none"
    # a null cap passes the mapping's config check (config.json's nulls are not compared) but not the op's
    assert _refused(tmp_path / "d", "gemma2", FAMILIES["gemma2"], final_logit_softcapping=None) == (
        f"{tmp_path}/d/hf: config.json asks for final_logit_softcapping = none, but spec gemma2_tiny's softcap ops model 2.0")


def test_rope_parameters_per_layer_type_are_checked_per_layer():
    """Gemma 3's rope_parameters, one set per layer type (transformers 5): each layer's rotary is
    checked against the set its layer type names. They were not read at all (a spec with the two
    bases swapped imported cleanly, off by 5.4); gemma2-tiny has one base, 10000, on every layer."""
    gemma2 = model_params(FAMILIES["gemma2"], with_graph=True)[3]
    types = ["sliding_attention", "full_attention"]
    same = {"rope_type": "default", "rope_theta": 10000.0}
    assert [op.id for op in gemma2.iter_ops() if op.kind == "rotary"][:2] == [
        "layers.0.self_attention.rotary", "layers.0.self_attention.rotary#2"]  # q's and k's: two per layer
    check_modeled(gemma2, {"layer_types": types, "sliding_window": 4, "num_hidden_layers": 3,
                           "rope_parameters": {"sliding_attention": same, "full_attention": same}}, "x", "gemma2_tiny")
    for params, message in [
        ({"sliding_attention": same, "full_attention": {"rope_type": "default", "rope_theta": 1000000.0}},
         "rope_theta = 1000000.0, but spec gemma2_tiny models 10000.0 at layers.1.self_attention.rotary"),
        ({"sliding_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 10000.0}, "full_attention": same},
         'rope_type = "linear", but spec gemma2_tiny models "default" at layers.0.self_attention.rotary'),
        ({"sliding_attention": same}, 'rope_theta = "no rope_parameters for full_attention", but spec gemma2_tiny'),
    ]:
        with pytest.raises(HFError) as e:
            check_modeled(gemma2, {"layer_types": types, "sliding_window": 4, "num_hidden_layers": 3,
                                   "rope_parameters": params}, "x", "gemma2_tiny")
        assert str(e.value).startswith(f"x: config.json asks for {message}"), str(e.value)
    with pytest.raises(HFError, match="rope_theta = .*sliding_attention"):  # keyed by type, no layer_types
        check_modeled(gemma2, {"rope_parameters": {"sliding_attention": same, "full_attention": same}}, "x",
                      "gemma2_tiny")


@pytest.mark.parametrize("key, value, what", [
    ("final_logit_softcapping", 4.0, "loss"),
    ("attn_logit_softcapping", 2.0, "logits"),
    ("sliding_window", 16, "logits"),  # no window within the 16 tokens
    ("modules.SelfAttention.submodules.core_attention.window_pattern", [0, 4], "logits"),
    ("modules.SelfAttention.submodules.core_attention.window_pattern", [4, 0, 0], "logits"),
    ("query_pre_attn_scalar", 16, "logits"),
])
def test_gemma2_parity_has_teeth(imported, key, value, what):
    """Each Gemma 2 feature changes the tiny model's output by far more than the parity's 1e-4: a
    wrong cap, no window, the window on the odd layers, the third layer's window (the pattern
    cycled), another score scale would each fail it."""
    batch = inputs()
    changed = specc_torch.build_model(FAMILIES["gemma2"], seed=1, overrides={key: value})
    load_checkpoint(imported["gemma2"][1], changed, allow_spec_change=True)
    logits, loss = specc_logits(changed, batch, ["tokens", "labels"], ProcessGroups.single().tp)
    expected_logits, expected_loss = imported["gemma2"][2]
    diff = {"logits": (logits - expected_logits).abs().max().item(), "loss": (loss - expected_loss).abs().max().item()}
    assert diff[what] > 100 * TOL, diff


def test_gemma2_files_without_layer_types_import_with_the_mappings_default(imported, tmp_path):
    """The released Gemma 2 config.json files predate layer_types (transformers fills in the
    alternating pattern): import reads the mapping's import_defaults for it."""
    import json
    import shutil

    hf_dir = str(tmp_path / "hf")
    shutil.copytree(imported["gemma2"][0], hf_dir)
    with open(os.path.join(hf_dir, "config.json")) as f:
        config = json.load(f)
    del config["layer_types"]
    with open(os.path.join(hf_dir, "config.json"), "w") as f:
        json.dump(config, f)
    import_hf(hf_dir, FAMILIES["gemma2"], str(tmp_path / "ckpt"))
    graph = model_params(FAMILIES["gemma2"], with_graph=True)[3]
    with pytest.raises(HFError, match="asks for sliding_window = 4, but spec gemma2_tiny models none at layers.1"):
        check_modeled(graph, config, "x", "gemma2_tiny")  # without the default: sliding everywhere, as Mistral's
