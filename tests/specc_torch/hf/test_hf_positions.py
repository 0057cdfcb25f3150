"""The position and normalization variants of issue 27 against transformers, from random models
built from tiny configs (no download) with every weight moved off its init (norm gains and
biases by about 0.3): BLOOM (ALiBi, its embedding LayerNorm, its per-head fused QKV), qwen2-tiny
with YaRN and phi3-tiny with LongRoPE scaling, Command R+ (q/k LayerNorms with one gain per head,
sharded with the heads; 2 K/V heads, so replicated at TP 4), OPT (learned positions from row 2),
MPT (ALiBi, bias-free LayerNorms, q, k and v clipped, its own score scale).

- import, then the compiled spec's logits and per-token loss equal transformers' to 1e-4 at TP 1,
  2 and 4 with and without SP, every case in ONE 4-rank gloo world (modules compiled once here);
- import then export gives back every HF tensor bit for bit;
- `specc verify` of the new families at TP x SP, TP 2 x CP 2 and PP 2 x TP 2, in one 4-rank world."""

from __future__ import annotations

import json
import os

import pytest
import torch
from hf_helpers import ROOT, batch, specc_logits
from safetensors.torch import load_file

from runtime.parallel_state import ProcessGroups
from specc_torch.hf import export_hf, import_hf

pytest.importorskip("transformers")
TOL = 1e-4
SETTINGS = [(1, False), (2, False), (2, True), (4, False), (4, True)]
_DECODER = dict(hidden_size=64, num_attention_heads=8, num_key_value_heads=4, intermediate_size=96,
                num_hidden_layers=2, vocab_size=256, max_position_embeddings=32, tie_word_embeddings=False)
# case -> (spec, transformers config class, its arguments); the batch is 32 tokens
CASES = {
    # 12 heads: not a power of two, so the slopes interleave two geometric series
    "bloom": ("specs/bloom-tiny.yaml", "BloomConfig", dict(vocab_size=256, hidden_size=96, n_layer=2, n_head=12)),
    # YaRN: factor 4 over an original context of 8 (long-context Qwen's rope_parameters)
    "qwen2-yarn": ("tests/specc_torch/specs/qwen2-yarn-tiny.yaml", "Qwen2Config",
                   dict(_DECODER, rms_norm_eps=1e-6, rope_parameters={
                       "rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0, "original_max_position_embeddings": 8})),
    # LongRoPE: 32 tokens past the original 16, so the long factors (Phi-3 128K's rope_parameters)
    "phi3-longrope": ("tests/specc_torch/specs/phi3-longrope-tiny.yaml", "Phi3Config",
                      dict(_DECODER, rms_norm_eps=1e-5, original_max_position_embeddings=16, pad_token_id=0,
                           bos_token_id=0, eos_token_id=0, rope_parameters={
                               "rope_type": "longrope", "rope_theta": 10000.0, "short_factor": [1.0, 1.25, 2.0, 3.5],
                               "long_factor": [1.5, 3.0, 6.0, 11.0], "original_max_position_embeddings": 16})),
    "cohere-plus": ("specs/cohere-plus-tiny.yaml", "CohereConfig",
                    dict(_DECODER, num_key_value_heads=2, layer_norm_eps=1e-5, logit_scale=0.5, use_qk_norm=True,
                         tie_word_embeddings=True, rope_parameters={"rope_type": "default", "rope_theta": 10000.0})),
    # MPT: ALiBi by its own formula (12 heads: the slopes interleave), bias-free LayerNorms, q, k and v
    # clipped (clip_qkv) and a score scale of its own (softmax_scale), so both bite
    "mpt": ("specs/mpt-tiny.yaml", "MptConfig", dict(vocab_size=256, d_model=96, n_layers=2, n_heads=12, max_seq_len=32,
                                                     attn_config={"clip_qkv": 0.5, "softmax_scale": 0.25})),
    "opt": ("specs/opt-tiny.yaml", "OPTConfig", dict(vocab_size=256, hidden_size=64, num_hidden_layers=2, ffn_dim=128,
                                                     num_attention_heads=4, max_position_embeddings=32, dropout=0.0,
                                                     word_embed_proj_dim=64, pad_token_id=1, bos_token_id=2,
                                                     eos_token_id=2)),
}


def _spec(case: str) -> str:
    return os.path.join(ROOT, CASES[case][0])


def _hf_config(case: str):
    import transformers

    _, cls, kw = CASES[case]
    return getattr(transformers, cls)(**kw)


def _hf_model(case: str, seed: int = 11):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(_hf_config(case), attn_implementation="eager")
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * (0.3 if p.dim() == 1 else 0.05))
    return model.eval()


@torch.no_grad()
def _hf_logits(model, seq: int = 32) -> tuple[torch.Tensor, torch.Tensor]:
    """(the output layer's logits, the per-token loss of the model's: Cohere scales them after)."""
    tokens, labels = batch(s=seq)
    captured = []
    handle = model.get_output_embeddings().register_forward_hook(lambda m, i, out: captured.append(out.float()))
    logits = model(input_ids=tokens).logits.float()
    handle.remove()
    loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1),
                                             reduction="none").reshape(labels.shape)
    return captured[0], loss


def _parity_on_ranks(rank, world, cases, sources):
    """On 4 ranks, for each TP size a fresh grid of TP groups: every case loaded into it with and
    without SP; the largest logit and loss differences from transformers' per setting."""
    from runtime.checkpoint import load_checkpoint
    from specc_torch.api import load_module_from_source

    out = {}
    for tp in (1, 2, 4):
        pg = ProcessGroups.initialize(tp=tp)
        try:
            for sp in (False, True) if tp > 1 else (False,):
                for case, ckpt, expected, expected_loss in cases:
                    model = load_module_from_source(*sources[case, tp, sp]).build_model(pg, seed=123)
                    load_checkpoint(ckpt, model, pg)
                    logits, loss = specc_logits(model, pg)
                    out[case, tp, sp] = ((logits - expected).abs().max().item(),
                                         (loss - expected_loss).abs().max().item())
        finally:
            pg.destroy()
    return out


@pytest.fixture(scope="module")
def imported(tmp_path_factory):
    """case -> (HF directory, imported checkpoint, HF model)."""
    from transformers.utils import logging

    logging.disable_progress_bar()
    root = tmp_path_factory.mktemp("positions")
    out = {}
    for case in CASES:
        model = _hf_model(case)
        hf_dir, ckpt = str(root / case / "hf"), str(root / case / "ckpt")
        model.save_pretrained(hf_dir)
        import_hf(hf_dir, _spec(case), ckpt)
        out[case] = (hf_dir, ckpt, model)
    return out


def test_logits_match_transformers_at_tp_1_2_4_with_and_without_sp(gloo, imported):
    from specc.settings import Settings
    from specc_torch.api import compile_source

    cases, sources = [], {}
    for case in CASES:
        cases.append((case, imported[case][1], *_hf_logits(imported[case][2])))
        for tp, sp in SETTINGS:
            text, spec, _ = compile_source(_spec(case), Settings(tp=tp, sp=sp))
            sources[case, tp, sp] = (text, spec.name)
    diffs = gloo.run(4, _parity_on_ranks, cases, sources)[0]
    assert sorted(diffs) == sorted((case, tp, sp) for case in CASES for tp, sp in SETTINGS)
    for key, (logit_diff, loss_diff) in diffs.items():
        assert logit_diff < TOL and loss_diff < TOL, (key, logit_diff, loss_diff)


@pytest.mark.parametrize("case", sorted(CASES))
def test_import_then_export_round_trips_bit_exactly(imported, tmp_path, case):
    hf_dir, ckpt, _ = imported[case]
    export_hf(ckpt, _spec(case), str(tmp_path / "out"))
    original = load_file(os.path.join(hf_dir, "model.safetensors"))
    exported = load_file(str(tmp_path / "out" / "model.safetensors"))
    assert sorted(original) == sorted(exported)
    for name, t in original.items():
        assert torch.equal(exported[name], t), name


@torch.no_grad()
def _specc_logits(spec: str, ckpt: str, seq: int = 32, overrides: dict | None = None) -> torch.Tensor:
    import specc_torch
    from runtime.checkpoint import load_checkpoint

    model = specc_torch.build_model(spec, seed=1, overrides=overrides or {})
    load_checkpoint(ckpt, model, allow_spec_change=bool(overrides))
    captured = []
    handle = model.output_layer.register_forward_hook(lambda m, i, out: captured.append(out.detach()))
    model.eval()
    model(*batch(s=seq))
    handle.remove()
    return captured[0].float().transpose(0, 1)


def test_longrope_takes_its_short_factors_up_to_the_original_context_and_each_variant_has_teeth(imported):
    """At 16 tokens (the original context) LongRoPE's short factors, as transformers picks them;
    and the parity above fails without what each variant adds: no ALiBi, LongRoPE's short factors
    at 32 tokens, YaRN without its attention factor, Cohere's rotary on rotate-half pairs, OPT's
    positions from row 0, MPT without its clip or with the default score scale."""
    _, ckpt, model = imported["phi3-longrope"]
    assert (_specc_logits(_spec("phi3-longrope"), ckpt, seq=16) - _hf_logits(model, 16)[0]).abs().max().item() < TOL
    rotary = "modules.SelfAttention.submodules.rotary."
    for case, key, value in [("bloom", "modules.SelfAttention.submodules.core_attention.alibi", False),
                             ("phi3-longrope", rotary + "long_factor", [1.0, 1.25, 2.0, 3.5]),
                             ("qwen2-yarn", rotary + "attention_factor", 1.0),
                             ("cohere-plus", rotary + "interleaved", False),
                             ("opt", "modules.OPTModel.submodules.position_embedding.offset", 0),
                             ("mpt", "modules.SelfAttention.submodules.clip_qkv.bound", 100.0),
                             ("mpt", "modules.SelfAttention.submodules.core_attention.scale", 8 ** -0.5)]:
        _, ckpt, model = imported[case]
        diff = (_specc_logits(_spec(case), ckpt, overrides={key: value}) - _hf_logits(model)[0]).abs().max().item()
        assert diff > 100 * TOL, (case, key, diff)


def test_configs_the_ops_do_not_model_are_refused():
    """BLOOM's ALiBi and OPT's position offset (import_defaults: config.json never says them),
    another ALiBi bias or chunk size, YaRN's ramp and LongRoPE's factors and derived attention
    factor, MPT's clip_qkv (another, or one where the spec has none) and softmax_scale, op by op;
    what MPT's config asks for that no op models (q/k LayerNorms, biases, multi-query attention),
    by the mapping."""
    from specc_torch.hf import HFError, mapping_of, model_params
    from specc_torch.hf.checks import check_config, check_modeled

    bloom = model_params(_spec("bloom"), {"modules.SelfAttention.submodules.core_attention.alibi": False},
                         with_graph=True)[3]
    yarn = model_params(_spec("qwen2-yarn"), with_graph=True)[3]
    gpt = model_params(os.path.join(ROOT, "specs", "gpt-tiny.yaml"), with_graph=True)[3]
    longrope = model_params(_spec("phi3-longrope"), with_graph=True)[3]
    mpt_spec, _, _, mpt = model_params(_spec("mpt"), with_graph=True)
    mpt7b = model_params(os.path.join(ROOT, "specs", "mpt.yaml"), with_graph=True)[3]
    rope = dict(CASES["qwen2-yarn"][2]["rope_parameters"])
    long = dict(CASES["phi3-longrope"][2]["rope_parameters"])
    check_modeled(yarn, {"rope_parameters": rope}, "x", "y")
    check_modeled(longrope, {"rope_parameters": long, "max_position_embeddings": 32}, "x", "y")
    for graph, config, message in [
        (bloom, {"alibi": True}, "alibi = true, but spec y models false at layers.0.self_attention.core_attention"),
        (gpt, {"position_embedding_offset": 2}, "position_embedding_offset = 2, but spec y models 0 at position_embedding"),
        (yarn, {"attn_config": {"alibi": True, "alibi_bias_max": 8}}, "alibi = true, but spec y models false"),
        (yarn, {"attention_chunk_size": 8}, "attention_chunk_size = 8, but spec y models none"),
        (yarn, {"rope_parameters": {**rope, "beta_fast": 16}}, "rope beta_fast = 16, but spec y models 32.0"),
        (yarn, {"rope_parameters": {**rope, "mscale": 1.0, "mscale_all_dim": 0.5}},
         "rope attention factor = 1.0648"),
        (longrope, {"rope_parameters": {**long, "short_factor": [1.0] * 4}, "max_position_embeddings": 32},
         "rope short_factor = [1.0, 1.0, 1.0, 1.0], but spec y models [1.0, 1.25, 2.0, 3.5]"),
        (longrope, {"rope_parameters": long, "max_position_embeddings": 64}, "rope factor = 4.0, but spec y models 2.0"),
        (mpt, {"attn_config": {"clip_qkv": 1.0}}, "clip_qkv = 1.0, but spec y's clamp ops model 0.5"),
        (mpt, {"attn_config": {"clip_qkv": None}}, "clip_qkv = none, but spec y's clamp ops model 0.5"),
        (mpt7b, {"attn_config": {"clip_qkv": 8}}, "clip_qkv = 8, but spec y's clamp ops model none"),
        (mpt7b, {"attn_config": {"softmax_scale": 0.1}}, "softmax_scale = 0.1, but spec y models none at layers.0"),
        (mpt, {"attn_config": {"softmax_scale": None}}, "softmax_scale = none, but spec y models 0.25 at layers.0"),
        (mpt, {"attn_config": {"alibi_bias_max": 16}}, "alibi_bias_max = 16, but spec y models 8.0 at layers.0"),
    ]:
        with pytest.raises(HFError) as e:
            check_modeled(graph, config, "x", "y")
        assert str(e.value).startswith(f"x: config.json asks for {message}"), str(e.value)
    config = json.loads(json.dumps(_hf_config("mpt").to_dict()))
    mapping = mapping_of(mpt_spec)
    check_config(mapping, config, "x", "y")
    for key, value in [("qk_ln", True), ("attn_type", "multiquery_attention"), ("prefix_lm", True),
                       ("attn_uses_sequence_id", True)]:
        with pytest.raises(HFError, match=f"^x: config.json has attn_config.{key} = "):
            check_config(mapping, {**config, "attn_config": {**config["attn_config"], key: value}}, "x", "y")
    for key, value in [("no_bias", False), ("logit_scale", 2.0), ("embedding_fraction", 0.5)]:
        with pytest.raises(HFError, match=f"^x: config.json has {key} = "):
            check_config(mapping, {**config, key: value}, "x", "y")


def _verify(rank, world, cases):
    from specc_torch.verify import VerifyConfig, _verify_all

    out = []
    for spec, kw in cases:
        out += [(spec, row) for row in _verify_all(rank, VerifyConfig(spec=os.path.join(ROOT, spec), steps=1, **kw))]
    return out


def test_verify_at_tp_x_sp_cp_2_and_pp_2(gloo):
    """`specc verify` (loss, logits, activations, gradients, weights after a step, from the initial
    and randomized weights; collectives against the plan) on one world of 4 ranks: BLOOM at TP 1, 2
    and 4 with and without SP, TP 2 x CP 2 (ALiBi by global position) and PP 2 x TP 2; LongRoPE at
    CP 2 (the whole sequence's length picks the long factors on every rank); Command R+ at TP 4 with
    SP (its K norm gains replicated over 2 ranks, their gradients summed; its CP 2 and PP 2 are
    `specc verify specs/cohere-plus-tiny.yaml --tp 2 --sp on --cp 2` and `--pp 2 --batch 4`); OPT at
    TP 2 x CP 2 (the offset rows at the chunks' global positions); MPT (its clamp on the head-sharded
    fused QKV) at TP 4 with and without SP, TP 2 x CP 2 and PP 2 x TP 2."""
    cases = [("specs/bloom-tiny.yaml", dict(tps=[1, 2], sps=[False, True])),
             ("specs/bloom-tiny.yaml", dict(tps=[4], sps=[False, True])),
             ("specs/bloom-tiny.yaml", dict(tps=[2], sps=[True], cps=[2], pp_settings=[(2, None, 2, 1, True)],
                                            pps=[2])),
             ("tests/specc_torch/specs/phi3-longrope-tiny.yaml", dict(tps=[1], sps=[False], cps=[2])),
             ("specs/cohere-plus-tiny.yaml", dict(tps=[4], sps=[True])),
             ("specs/opt-tiny.yaml", dict(tps=[2], sps=[True], cps=[2])),
             ("specs/mpt-tiny.yaml", dict(tps=[4], sps=[False, True])),
             ("specs/mpt-tiny.yaml", dict(tps=[2], sps=[True], cps=[2], pp_settings=[(2, None, 2, 1, True)], pps=[2]))]
    rows = [row for case in cases for row in gloo.run(4, _verify, [case])[0]]  # each call within the pool's limit
    bad = [r for _, r in rows if not r.ok]
    assert not bad, bad
    settings = sorted({(spec, r.setting) for spec, r in rows})
    assert {s for _, s in settings} >= {"tp=1 sp=off", "tp=2 sp=on", "tp=4 sp=on", "tp=2 cp=2 sp=on",
                                        "pp=2 tp=2 sp=on", "tp=1 cp=2 sp=off"}, settings
    assert {s for spec, s in settings if "cohere" in spec} >= {"tp=4 sp=on"}
    assert {s for spec, s in settings if "mpt" in spec} >= {"tp=4 sp=off", "tp=4 sp=on", "tp=2 cp=2 sp=on",
                                                            "pp=2 tp=2 sp=on"}
