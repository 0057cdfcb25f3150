"""Hugging Face interop for the GPT-2-style and Llama-style specs, with small random models built
by transformers from a config (no download):

- import: HF -> specc checkpoint -> the compiled spec at TP=1 and TP=2 (+SP) gives HF's logits
  and loss to 1e-4;
- export: a specc checkpoint saved at TP=2 -> HF directory -> transformers' from_pretrained gives
  the compiled model's logits to 1e-4;
- import then export gives back every tensor bit for bit (fp32 and bf16);
- the rotary permutation for interleaved layouts, and what a mismatch reports."""

from __future__ import annotations

import json
import os

import pytest
import torch
from hf_helpers import SPECS, hf_logits, hf_loss, hf_model, load_and_run, save_hf, save_specc, specc_logits
from safetensors.torch import load_file

import runtime
import specc_torch
from runtime.checkpoint import load_checkpoint, read_info
from specc.errors import SpecError
from specc_torch.hf import HFError, export_hf, import_hf
from specc_torch.hf.convert import model_params
from specc_torch.hf.layouts import half_to_interleaved, interleaved_to_half, with_rotary
from specc_torch.hf.mapping import mapping_of

pytest.importorskip("transformers")
FAMILIES = ["gpt", "llama"]
TOL = 1e-4


@pytest.mark.parametrize("family", FAMILIES)
def test_import_matches_hf_logits_at_tp1_and_tp2(gloo, tmp_path, family):
    hf_dir, ckpt = str(tmp_path / "hf"), str(tmp_path / "ckpt")
    model = save_hf(family, hf_dir)
    expected = hf_logits(model)
    expected_loss = hf_loss(expected)
    done = import_hf(hf_dir, SPECS[family], ckpt)
    assert done["spec"] == f"{family}_tiny" and done["parameters"] == sum(p.numel() for p in model.parameters())
    assert read_info(done["path"])["config"]["hf_import"]["architecture"] == model.config.architectures[0]

    logits, loss = load_and_run(0, 1, family, ckpt)
    assert (logits - expected).abs().max().item() < TOL
    assert (loss - expected_loss).abs().max().item() < TOL
    for rank_logits, rank_loss in gloo.run(2, load_and_run, family, ckpt):
        assert (rank_logits - expected).abs().max().item() < TOL
        assert (rank_loss - expected_loss).abs().max().item() < TOL


@pytest.mark.parametrize("family", FAMILIES)
def test_export_of_a_tp2_checkpoint_loads_in_transformers(gloo, tmp_path, family):
    from transformers import AutoModelForCausalLM

    ckpt, hf_dir = str(tmp_path / "ckpt"), str(tmp_path / "hf")
    logits, _ = gloo.run(2, save_specc, family, ckpt)[0]
    done = export_hf(ckpt, SPECS[family], hf_dir)
    assert done["step"] == 9
    model = AutoModelForCausalLM.from_pretrained(hf_dir).eval()
    assert type(model).__name__ == {"gpt": "GPT2LMHeadModel", "llama": "LlamaForCausalLM"}[family]
    assert (hf_logits(model) - logits).abs().max().item() < TOL
    # and the export imports back to the same weights
    back = str(tmp_path / "back")
    import_hf(hf_dir, SPECS[family], back)
    a, b = specc_torch.build_model(SPECS[family], seed=1), specc_torch.build_model(SPECS[family], seed=2)
    load_checkpoint(ckpt, a)
    load_checkpoint(back, b)
    assert all(torch.equal(x, y) for x, y in zip(a.parameters(), b.parameters()))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("family", FAMILIES)
def test_import_then_export_round_trips_bit_exactly(tmp_path, family, dtype):
    hf_dir, ckpt, out = str(tmp_path / "hf"), str(tmp_path / "ckpt"), str(tmp_path / "out")
    save_hf(family, hf_dir, seed=3, dtype=dtype)
    import_hf(hf_dir, SPECS[family], ckpt)
    export_hf(ckpt, SPECS[family], out)
    original, exported = load_file(os.path.join(hf_dir, "model.safetensors")), load_file(os.path.join(out, "model.safetensors"))
    assert sorted(original) == sorted(exported)
    for name, t in original.items():
        assert exported[name].dtype == t.dtype == dtype and torch.equal(exported[name], t), name
    config = json.load(open(os.path.join(out, "config.json")))
    source = json.load(open(os.path.join(hf_dir, "config.json")))
    for key in ("model_type", "vocab_size", "architectures", "tie_word_embeddings"):
        assert config[key] == source[key], key


def test_the_interleaved_rotary_permutation_keeps_attention_scores():
    """Rotary with interleaved pairs (GPT-J's layout) on HF-layout weights gives the same q.k as
    specc's rotate-half rotary on the permuted weights: the import permutation is right."""
    torch.manual_seed(0)
    heads, d, s, hidden = 3, 8, 6, 16
    wq, wk, x = torch.randn(heads * d, hidden), torch.randn(heads * d, hidden), torch.randn(s, 1, hidden)
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, d, 2, dtype=torch.float64) / d)).float()
    angles = torch.outer(torch.arange(s, dtype=torch.float32), inv_freq)  # [s, d/2]

    def rope_interleaved(t):  # pairs (2i, 2i+1) rotate by angle i
        t = t.reshape(s, 1, heads, d // 2, 2)
        cos, sin = angles.cos()[:, None, None, :], angles.sin()[:, None, None, :]
        x0, x1 = t[..., 0], t[..., 1]
        return torch.stack([x0 * cos - x1 * sin, x0 * sin + x1 * cos], dim=-1).reshape(s, 1, heads * d)

    def scores(q, k):
        q, k = q.reshape(s, heads, d), k.reshape(s, heads, d)
        return torch.einsum("shd,thd->hst", q, k)

    reference = scores(rope_interleaved(x @ wq.t()), rope_interleaved(x @ wk.t()))
    rotary = runtime.RotaryEmbedding(d)
    wq2, wk2 = interleaved_to_half(wq, d), interleaved_to_half(wk, d)
    assert torch.allclose(scores(rotary(x @ wq2.t()), rotary(x @ wk2.t())), reference, atol=1e-4)
    assert torch.equal(half_to_interleaved(wq2, d), wq)  # export undoes import exactly
    assert not torch.allclose(scores(rotary(x @ wq.t()), rotary(x @ wk.t())), reference, atol=1e-2)


def test_a_partial_rotary_permutes_only_the_features_that_rotate(tmp_path):
    """GPT-J rotates interleaved pairs of the first rotary_dim features of each head and passes
    the rest through: the import permutation moves those rows only, as the spec's rotary op reads
    them (a whole-head permutation imported GPT-J written this way off by 0.53). The rotary
    features are the spec's rotary ops': its hf.rotary head_dim must match theirs."""
    torch.manual_seed(0)
    heads, d, r, s, hidden = 3, 8, 4, 6, 16
    wq, wk, x = torch.randn(heads * d, hidden), torch.randn(heads * d, hidden), torch.randn(s, 1, hidden)

    def scores(q, k):
        return torch.einsum("shd,thd->hst", q.reshape(s, heads, d), k.reshape(s, heads, d))

    gptj = runtime.RotaryEmbedding(d, rotary_dim=r, interleaved=True)  # HF's layout, as GPT-J computes it
    reference = scores(gptj(x @ wq.t()), gptj(x @ wk.t()))
    half = runtime.RotaryEmbedding(d, rotary_dim=r)  # specc's op: rotate-half on the first r features
    wq2, wk2 = interleaved_to_half(wq, d, r), interleaved_to_half(wk, d, r)
    assert torch.allclose(scores(half(x @ wq2.t()), half(x @ wk2.t())), reference, atol=1e-4)
    assert torch.equal(wq2.reshape(heads, d, hidden)[:, r:], wq.reshape(heads, d, hidden)[:, r:])  # passed through
    assert torch.equal(half_to_interleaved(wq2, d, r), wq)
    whole = interleaved_to_half(wq, d), interleaved_to_half(wk, d)  # the old whole-head permutation
    assert not torch.allclose(scores(half(x @ whole[0].t()), half(x @ whole[1].t())), reference, atol=1e-2)

    neox = os.path.join(os.path.dirname(SPECS["llama"]), "gpt-neox-tiny.yaml")  # 4 heads of 16, rotary on 4
    for head_dim, expected in ((16, 4), (8, None)):
        spec_path = tmp_path / f"gptj{head_dim}.yaml"
        spec_path.write_text(f"name: gptj_like\nextends: {neox}\nhf:\n  rotary: {{layout: interleaved, head_dim: "
                             f"{head_dim}}}\n")
        spec, _, _, graph = model_params(str(spec_path), with_graph=True)
        if expected is None:
            with pytest.raises(HFError, match="hf.rotary.head_dim is 8, but its rotary ops' head_dim is 16"):
                with_rotary(mapping_of(spec), graph, spec.name)
        else:
            assert with_rotary(mapping_of(spec), graph, spec.name).rotary_dim == expected


def test_hf_logits_without_the_mapping_differ(tmp_path):
    """The comparison above has teeth: specc's own weights give other logits than HF's model."""
    model = hf_model("gpt")
    other = specc_torch.build_model(SPECS["gpt"], seed=1)
    logits, _ = specc_logits(other, runtime.ProcessGroups.single())
    assert (logits - hf_logits(model)).abs().max().item() > 0.1


# -- what does not fit is named ------------------------------------------------------------------------

def _import_error(tmp_path, family, spec=None, **changes) -> str:
    hf_dir = str(tmp_path / "hf")
    save_hf(family, hf_dir, **changes)
    with pytest.raises((HFError, SpecError)) as e:
        import_hf(hf_dir, spec or SPECS[family], str(tmp_path / "ckpt"))
    assert not os.path.exists(tmp_path / "ckpt")  # nothing half-written
    return str(e.value)


def test_config_mismatches_are_named(tmp_path):
    # 8 heads instead of 4: every tensor has the right shape, only the config tells
    assert _import_error(tmp_path, "gpt", n_head=8) == (f"{tmp_path}/hf: config.json has n_head = 8, but spec "
                                                        f"gpt_tiny gives 4")
    # gpt.yaml's MLP is GPT-2's tanh GELU (gelu_new): a checkpoint trained with the exact GELU is refused
    assert _import_error(tmp_path / "b", "gpt", activation_function="gelu") == (
        f"{tmp_path}/b/hf: config.json has activation_function = \"gelu\", but spec gpt_tiny gives \"gelu_new\"")
    assert _import_error(tmp_path / "c", "llama", rope_parameters={"rope_type": "default", "rope_theta": 500000.0}) == (
        f"{tmp_path}/c/hf: config.json has rope_parameters.rope_theta = 500000.0, but spec llama_tiny gives 10000.0")
    assert _import_error(tmp_path / "d", "llama", spec=SPECS["gpt"]) == (
        f"{tmp_path}/d/hf: the model is LlamaForCausalLM, but spec gpt_tiny maps GPT2LMHeadModel")


def test_tensor_mismatches_are_named(tmp_path):
    from safetensors.torch import save_file

    hf_dir = str(tmp_path / "hf")
    save_hf("llama", hf_dir)
    weights = load_file(os.path.join(hf_dir, "model.safetensors"))

    def fails(tensors) -> str:
        save_file(tensors, os.path.join(hf_dir, "model.safetensors"), metadata={"format": "pt"})
        with pytest.raises(HFError) as e:
            import_hf(hf_dir, SPECS["llama"], str(tmp_path / "ckpt"))
        return str(e.value)

    missing = {k: v for k, v in weights.items() if k != "model.layers.1.self_attn.k_proj.weight"}
    assert fails(missing) == (f"{hf_dir}: no tensor model.layers.1.self_attn.k_proj.weight "
                              f"(for layers.1.self_attention.linear_qkv.weight)")
    assert fails({**weights, "model.layers.0.mlp.extra.weight": torch.zeros(2)}) == (
        f"{hf_dir}: tensor model.layers.0.mlp.extra.weight is not in spec llama_tiny's hf mapping (map it, or "
        f"list it under hf.ignore)")
    narrow = dict(weights, **{"model.layers.0.mlp.up_proj.weight": torch.zeros(48, 64)})
    assert fails(narrow) == (f"{hf_dir}: model.layers.0.mlp.up_proj.weight has shape [48, 64], but segment of "
                             f"layers.0.mlp.linear_fc1.weight has 96 along dim 0")
    wide = dict(weights, **{"model.embed_tokens.weight": torch.zeros(256, 32)})
    assert fails(wide) == (f"{hf_dir}: model.embed_tokens.weight gives embedding.weight the shape [256, 32], "
                           f"but spec llama_tiny has [256, 64]")


def test_a_spec_the_mapping_does_not_fit(tmp_path):
    """parallel-block extends gpt.yaml and so inherits its GPT-2 mapping, which names a parameter
    the parallel block does not have: refused, located at the mapping entry."""
    spec = os.path.join(os.path.dirname(SPECS["gpt"]), "parallel-block-tiny.yaml")
    with pytest.raises(SpecError) as e:
        import_hf(str(tmp_path), spec, str(tmp_path / "ckpt"))
    assert e.value.loc.path.endswith("specs/gpt.yaml")
    assert e.value.what.startswith("'layers.{i}.self_attention.linear_qkv.bias' matches no parameter of model "
                                   "parallel_block_tiny")


def test_outputs_are_never_overwritten(tmp_path):
    hf_dir = str(tmp_path / "hf")
    save_hf("gpt", hf_dir)
    os.makedirs(tmp_path / "taken")
    (tmp_path / "taken" / "x").write_text("mine")
    with pytest.raises(HFError, match="taken: already exists and is not empty"):
        import_hf(hf_dir, SPECS["gpt"], str(tmp_path / "taken"))
    import_hf(hf_dir, SPECS["gpt"], str(tmp_path / "ckpt"))
    with pytest.raises(HFError, match="taken: already exists and is not empty"):
        export_hf(str(tmp_path / "ckpt"), SPECS["gpt"], str(tmp_path / "taken"))
    assert (tmp_path / "taken" / "x").read_text() == "mine"
