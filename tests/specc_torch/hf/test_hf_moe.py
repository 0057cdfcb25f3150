"""Hugging Face interop for the MoE specs: random MixtralForCausalLM and Qwen2MoeForCausalLM models
(built from a config, every weight moved off its init) import into specs/mixtral-tiny.yaml and
specs/qwen2-moe-tiny.yaml and give transformers' logits to 1e-4 at EP=1 and at EP=2 (2 gloo ranks,
the experts split between them, tokens dispatched by all-to-all), and export gives back every
per-expert tensor bit for bit."""

from __future__ import annotations

import os

import pytest
import torch

import specc_torch
from runtime.checkpoint import load_checkpoint
from runtime.parallel_state import ProcessGroups
from specc_torch.hf import import_hf

pytest.importorskip("transformers")
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
SPECS = {"mixtral": os.path.join(ROOT, "specs", "mixtral-tiny.yaml"),
         "qwen2_moe": os.path.join(ROOT, "specs", "qwen2-moe-tiny.yaml")}
TOL = 1e-4


def hf_config(family: str):
    common = dict(vocab_size=256, hidden_size=32, num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=4,
                  head_dim=4, max_position_embeddings=16, rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    if family == "mixtral":
        from transformers import MixtralConfig

        return MixtralConfig(intermediate_size=16, num_local_experts=8, num_experts_per_tok=2, rms_norm_eps=1e-5,
                             **common)
    from transformers import Qwen2MoeConfig

    return Qwen2MoeConfig(intermediate_size=24, moe_intermediate_size=8, shared_expert_intermediate_size=24,
                          num_experts=8, num_experts_per_tok=4, norm_topk_prob=False, rms_norm_eps=1e-6,
                          qkv_bias=True, **common)


def batch(b: int = 2, s: int = 16, vocab: int = 256, seed: int = 5):
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, vocab, (b, s + 1), generator=g)
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


def specc_logits(rank, world, family: str, ckpt: str):
    """Logits [b, s, vocab] of the tiny spec at EP=world (each rank the same batch), from `ckpt`."""
    pg = ProcessGroups.initialize(ep=world) if world > 1 else ProcessGroups.single()
    try:
        model = specc_torch.build_model(SPECS[family], pg, seed=123)
        load_checkpoint(ckpt, model, pg)
        captured = []
        model.output_layer.register_forward_hook(lambda m, i, out: captured.append(out.detach()))
        model.eval()
        with torch.no_grad():
            model(*batch())
        return captured[0].float().transpose(0, 1).contiguous()
    finally:
        pg.destroy()


@pytest.mark.parametrize("family", sorted(SPECS))
def test_import_matches_hf_logits_at_ep1_and_ep2(gloo, tmp_path, family):
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging

    logging.disable_progress_bar()
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(hf_config(family))
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)  # norm gains off 1, the router and shared gate off their init
    model.eval()
    hf_dir, ckpt = str(tmp_path / "hf"), str(tmp_path / "ckpt")
    model.save_pretrained(hf_dir)
    with torch.no_grad():
        expected = model(input_ids=batch()[0]).logits.float()
    done = import_hf(hf_dir, SPECS[family], ckpt)
    assert done["parameters"] == sum(p.numel() for p in model.parameters())

    assert (specc_logits(0, 1, family, ckpt) - expected).abs().max().item() < TOL
    for logits in gloo.run(2, specc_logits, family, ckpt):
        assert (logits - expected).abs().max().item() < TOL


@pytest.mark.parametrize("family", sorted(SPECS))
def test_import_then_export_gives_back_every_per_expert_tensor(tmp_path, family):
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from specc_torch.hf import export_hf

    torch.manual_seed(1)
    model = AutoModelForCausalLM.from_config(hf_config(family))
    hf_dir, ckpt, back = str(tmp_path / "hf"), str(tmp_path / "ckpt"), str(tmp_path / "back")
    model.save_pretrained(hf_dir)
    import_hf(hf_dir, SPECS[family], ckpt)
    export_hf(ckpt, SPECS[family], back)
    original, exported = load_file(os.path.join(hf_dir, "model.safetensors")), load_file(os.path.join(back, "model.safetensors"))
    assert sorted(exported) == sorted(original)
    assert any(".experts.7." in name for name in exported)  # one tensor per expert, as HF stores them
    for name, t in original.items():
        assert torch.equal(exported[name], t), name


@pytest.mark.parametrize("family,change,message", [
    # Qwen2-MoE does not renormalize the top-k weights; a spec that does was off by 0.72 in silence
    ("qwen2_moe", dict(norm_topk_prob=True), "norm_topk_prob = true, but spec qwen2_moe_tiny models false"),
    ("qwen2_moe", dict(num_experts_per_tok=2), "num_experts_per_tok = 2, but spec qwen2_moe_tiny models 4"),
    ("mixtral", dict(norm_topk_prob=False), "norm_topk_prob = false, but spec mixtral_tiny models true"),
    # DeepSeek-V3's routing knobs, which the op does not model, must be neutral
    ("mixtral", dict(routed_scaling_factor=2.5), "routed_scaling_factor = 2.5, but spec mixtral_tiny models 1.0"),
    ("mixtral", dict(n_group=8, topk_group=4), "n_group = 8, but spec mixtral_tiny models 1"),
    ("mixtral", dict(scoring_func="sigmoid"), 'scoring_func = "sigmoid", but spec mixtral_tiny models "softmax"'),
])
def test_routing_the_moe_op_does_not_model_is_refused(family, change, message):
    from specc_torch.hf import HFError, model_params
    from specc_torch.hf.checks import check_modeled

    graph = model_params(SPECS[family], with_graph=True)[3]
    config = hf_config(family).to_dict()
    check_modeled(graph, config, "x", f"{family}_tiny")  # the real config is what the spec models
    with pytest.raises(HFError) as e:
        check_modeled(graph, {**config, **change}, "x", f"{family}_tiny")
    assert str(e.value).startswith(f"x: config.json asks for {message} at layers.0.mlp"), str(e.value)
