"""Nemotron-H, a hybrid of Mamba-2, attention and MLP layers picked per layer by a pattern, against
transformers' NemotronHForCausalLM (its pure-torch Mamba-2 path: the chunked scan, no CUDA kernels),
from a random model whose every weight is moved off its init (A_log, D, dt_bias, the conv bias and
the norm gains by about 0.3):

- import, then specs/nemotron-h-tiny.yaml's logits and per-token loss equal transformers' to 1e-4 at
  TP 1, 2 and 4 with and without SP (one 4-rank gloo world; at TP 4 each rank holds 2 SSM heads of
  one group, the in-projection cut segment by segment), and export gives back every tensor bit for bit;
- `specc verify` at TP 4 with and without SP and at PP 2 x TP 2 with SP (loss, every activation,
  gradient and the weights after a step, the collectives the plan counts; TP 2 is TP 4's case
  with two groups a rank, and PP 2's stages run at TP 2);
- context parallelism and a TP size that splits a norm group are located errors;
- a config.json the spec does not model is refused on import: the mixer op's knobs (groups and
  state size trading off at equal tensor shapes, the activation), the layer kinds in either
  spelling, the dt clamp."""

from __future__ import annotations

import os

import pytest
import torch
from hf_helpers import ROOT, hf_logits, hf_loss, specc_logits

from runtime.parallel_state import ProcessGroups
from specc.errors import SpecError
from specc.settings import Settings
from specc_torch.hf import export_hf, import_hf

pytest.importorskip("transformers")
SPEC = os.path.join(ROOT, "specs", "nemotron-h-tiny.yaml")
TOL = 1e-4
SETTINGS = [(1, False), (2, False), (2, True), (4, False), (4, True)]
CONFIG = dict(vocab_size=256, hidden_size=32, hybrid_override_pattern="M*-M-", num_attention_heads=8,
              num_key_value_heads=2, head_dim=8, intermediate_size=64, mamba_num_heads=8, mamba_head_dim=4,
              ssm_state_size=6, n_groups=4, conv_kernel=4, chunk_size=5, layer_norm_epsilon=1e-5,
              max_position_embeddings=32, time_step_min=0.001)


def save_nemotron_h(directory: str, seed: int = 0):
    from transformers import NemotronHConfig, NemotronHForCausalLM
    from transformers.utils import logging

    logging.disable_progress_bar()
    torch.manual_seed(seed)
    model = NemotronHForCausalLM(NemotronHConfig(**CONFIG))
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * (0.3 if p.dim() == 1 else 0.05))
    model.eval().save_pretrained(directory)
    return model


def _parity_on_ranks(rank, world, ckpt, sources):
    from runtime.checkpoint import load_checkpoint
    from specc_torch.api import load_module_from_source

    out = {}
    for tp in (1, 2, 4):
        pg = ProcessGroups.initialize(tp=tp)
        try:
            for sp in (False, True) if tp > 1 else (False,):
                text, name = sources[tp, sp]
                model = load_module_from_source(text, name).build_model(pg, seed=123)
                load_checkpoint(ckpt, model, pg)
                out[tp, sp] = specc_logits(model, pg)
        finally:
            pg.destroy()
    return out


def test_nemotron_h_matches_transformers_at_tp_1_2_4_with_and_without_sp_and_exports_bit_for_bit(gloo, tmp_path):
    from safetensors.torch import load_file

    from specc_torch.api import compile_source

    hf_dir, ckpt, back = str(tmp_path / "hf"), str(tmp_path / "ckpt"), str(tmp_path / "back")
    model = save_nemotron_h(hf_dir, seed=11)
    expected = hf_logits(model)
    done = import_hf(hf_dir, SPEC, ckpt)
    assert done["parameters"] == sum(p.numel() for p in model.parameters())
    export_hf(ckpt, SPEC, back)
    original, exported = load_file(os.path.join(hf_dir, "model.safetensors")), load_file(os.path.join(back, "model.safetensors"))
    assert sorted(original) == sorted(exported)
    for name, t in original.items():
        assert torch.equal(exported[name], t), name

    sources = {}
    for tp, sp in SETTINGS:
        text, spec, _ = compile_source(SPEC, Settings(tp=tp, sp=sp))
        sources[tp, sp] = (text, spec.name)
    for rank, results in enumerate(gloo.run(4, _parity_on_ranks, ckpt, sources)):
        assert sorted(results) == sorted(SETTINGS)
        for (tp, sp), (logits, loss) in results.items():
            logit_diff = (logits - expected).abs().max().item()
            loss_diff = (loss - hf_loss(expected)).abs().max().item()
            assert logit_diff < TOL and loss_diff < TOL, (tp, sp, rank, logit_diff, loss_diff)


def test_nemotron_h_verifies_at_tp_x_sp_and_pp2():
    from specc_torch.verify import VerifyConfig, verify

    cfg = VerifyConfig(spec=SPEC, tps=[4], sps=[False, True], steps=1, batch=4, pp_settings=[(2, None, 2, 1, True)])
    rows = verify(cfg)
    bad = [f"{r.setting}: {r.quantity}: {r.detail}" for r in rows if not r.ok]
    assert not bad, bad
    assert {"tp=4 sp=off", "tp=4 sp=on", "pp=2 tp=2 sp=on"} <= {r.setting for r in rows}


@pytest.mark.parametrize("settings, where, message", [
    (dict(tp=1, cp=2), "nemotron-h.yaml:90:24:", "layers.0.mixer.ssm: context parallelism is not supported by the Mamba-2 scan"),
    (dict(tp=8), "nemotron-h.yaml:83:21:", "num_groups=4 is not divisible by tensor-model-parallel size 8: the gated norm "
                                        "normalizes groups of 8 features"),
])
def test_context_parallelism_and_a_tp_size_splitting_a_norm_group_are_located_errors(settings, where, message):
    from specc_torch.api import compile_source

    with pytest.raises(SpecError) as e:
        compile_source(SPEC, Settings(**settings))
    assert where in str(e.value) and message in str(e.value), str(e.value)


@pytest.mark.parametrize("check, change, message", [
    # the op's knobs, whatever the spec's hf.config lists: two groups of state 12 have the tensor
    # shapes of four groups of 6
    ("modeled", dict(n_groups=2, ssm_state_size=12), "ssm_state_size = 12, but spec nemotron_h_tiny models 6 at layers.0.mixer.ssm"),
    ("modeled", dict(mamba_hidden_act="gelu"), 'mamba_hidden_act = "gelu", but spec nemotron_h_tiny models "silu" at '
                                               "layers.0.mixer.ssm"),
    # the layer kinds, as transformers 5 writes them and as the published files do
    ("kinds", dict(layers_block_type=["linear_attention", "mlp", "full_attention", "linear_attention", "mlp"]),
     "layers_block_type has 5 layers and 'mlp' at layer 1, but spec nemotron_h_tiny builds full_attention there"),
    ("config", dict(hybrid_override_pattern="M-*M-"), 'hybrid_override_pattern = "M-*M-", but spec nemotron_h_tiny gives "M*-M-"'),
    ("config", dict(time_step_min=0.01), "time_step_min = 0.01, but spec nemotron_h_tiny gives 0.001"),
])
def test_a_config_the_spec_does_not_model_is_refused(check, change, message):
    from transformers import NemotronHConfig

    from specc_torch.hf import HFError, model_params
    from specc_torch.hf.checks import check_config, check_layer_kinds, check_modeled
    from specc_torch.hf.mapping import mapping_of

    spec, _, _, graph = model_params(SPEC, with_graph=True)
    mapping = mapping_of(spec)
    checks = {"config": lambda c: check_config(mapping, c, "x", spec.name),
              "modeled": lambda c: check_modeled(graph, c, "x", spec.name),
              "kinds": lambda c: check_layer_kinds(mapping, graph, c, "x", spec.name)}
    config = NemotronHConfig(**CONFIG).to_dict()
    for each in checks.values():
        each(config)  # what the spec models
    with pytest.raises(HFError) as e:
        checks[check]({**config, **change})
    assert message in str(e.value), str(e.value)
