"""Every Hugging Face config key that changes what a shipped family computes is either modelled by
the op that owns it or refused on import (issue 27's acceptance), walked key by key for every spec
in specs/ with an `hf:` mapping. The keys are every attribute of transformers' own config class
for the mapping's architecture (its defaults: sub-configs such as MPT's attn_config included, one
level down). A key is

- owned: an op kind the spec uses declares an HFKnob that reads it (import compares what
  config.json asks with what each op of that kind does; `any` knobs, such as the tied output or the
  logit soft cap, count for every spec: no op of the kind is a request too). Read means read by a
  knob in the class's config, in it with keys a knob read removed (an older file's spelling:
  rope_theta beside rope_scaling, use_sliding_window without layer_types), or with the rope scaled
  by YaRN or LongRoPE without their lengths (their factors are derived from the context lengths);
- pinned: the mapping's hf.config, import_config, import_defaults or layer_types key, which import
  compares with config.json (a value the spec does not give is refused);
- or listed below with the reason it does not change the math (bookkeeping, generation, training
  noise, initialization), or how import refuses it another way (a tensor check).

No model is built: configs and specs only."""

from __future__ import annotations

import glob
import json
import os

import pytest

pytest.importorskip("transformers")

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

# Keys that never change a family's math, by name (also inside a sub-config such as attn_config).
NOT_MATH = {
    **dict.fromkeys(["_name_or_path", "architectures", "transformers_version", "model_type", "id2label", "label2id",
                     "problem_type", "is_encoder_decoder", "return_dict", "output_attentions", "output_hidden_states",
                     "output_router_logits"],
                    "bookkeeping, or what the forward returns, not what it computes (import checks architectures "
                    "against hf.architecture itself)"),
    "dtype": "the dtype the weights were saved in: import reads each tensor's own dtype",
    **dict.fromkeys(["use_cache", "num_logits_to_keep", "mamba_ssm_cache_dtype"],
                    "generation: the K/V (or SSM state) cache and which logits a step keeps"),
    **dict.fromkeys(["bos_token_id", "eos_token_id", "pad_token_id"],
                    "token ids for generation and padding: the forward of a sequence does not read them"),
    **dict.fromkeys(["initializer_range", "init_std", "init_device", "rescale_prenorm_residual", "time_step_floor",
                     "time_step_max"],
                    "initialization only: import loads every weight"),
    **dict.fromkeys(["attention_dropout", "hidden_dropout", "attention_probs_dropout_prob", "hidden_dropout_prob",
                     "classifier_dropout", "attn_pdrop", "embd_pdrop", "resid_pdrop", "emb_pdrop",
                     "embedding_dropout", "residual_dropout", "dropout", "summary_first_dropout", "layerdrop",
                     "router_jitter_noise"],
                    "training noise (dropout, layer drop, router jitter): the spec's dropout ops and training "
                    "flags choose it; evaluation runs without it"),
    "router_aux_loss_coef": "the load-balancing loss's weight: a training term the spec's moe op sets (Megatron's "
                            "--moe-aux-loss-coeff), not in the logits",
    **dict.fromkeys(["pretraining_tp", "slow_but_exact", "chunk_size_feed_forward", "attn_impl", "use_mamba_kernels"],
                    "the same math computed another way (matmuls in slices, feed-forward in chunks, a kernel)"),
    **dict.fromkeys(["summary_type", "summary_use_proj", "summary_activation", "summary_proj_to_labels"],
                    "GPT2DoubleHeadsModel's sequence-summary head, not in GPT2LMHeadModel"),
}

# Keys that change no math of one architecture's transformers model, or that import refuses by
# the tensors it reads rather than by config.json.
BY_ARCHITECTURE = {
    "GPTNeoXForCausalLM": {"is_decoder": "unread by transformers' GPT-NeoX, which is always causal"},
    "MptForCausalLM": {
        "max_seq_len": "bounds the ALiBi bias table transformers slices: no other math",
        "learned_pos_emb": "transformers' MPT builds no position table, whatever it says (a transformer.wpe tensor "
                           "is refused on import: not in the mapping)",
        "norm_type": "transformers' MPT runs a plain LayerNorm whatever it names",
    },
    "DeepseekV3ForCausalLM": {
        **dict.fromkeys(["head_dim", "qk_head_dim"], "derived by transformers from qk_rope_head_dim and "
                        "qk_nope_head_dim (owned by core_attention's and the rotary op's knobs); config.json's "
                        "value is overwritten"),
        "num_nextn_predict_layers": "multi-token prediction: layers after the model and a training loss, not in "
                                    "its logits (transformers builds none); their tensors (model.layers.61.*) are "
                                    "refused on import, not in the mapping (test_hf_deepseek.py)",
    },
    "NemotronHForCausalLM": {
        "max_position_embeddings": "no position embedding (attention without rope): unread",
        "expand": "unread by transformers' NemotronH (the mixer's width is mamba_num_heads x mamba_head_dim, "
                  "owned by the mamba2_mixer op)",
        "time_step_limit": "unread by transformers' NemotronH: it clamps dt at (time_step_min, inf), "
                           "time_step_min owned by the mamba2_mixer op",
        **dict.fromkeys(["moe_intermediate_size", "moe_latent_size", "moe_shared_expert_intermediate_size",
                         "moe_shared_expert_overlap", "n_group", "n_routed_experts", "n_shared_experts",
                         "norm_topk_prob", "num_experts_per_tok", "routed_scaling_factor", "topk_group"],
                        "MoE layers only ('moe' in layers_block_type, refused by the layer-kinds check: the spec "
                        "builds none)"),
        **dict.fromkeys(["num_nextn_predict_layers", "mtp_layers_block_type"],
                        "multi-token prediction: transformers builds none; its mtp.* tensors are refused on import, "
                        "not in the mapping"),
    },
    **{arch: {"max_window_layers": "which layers slide when use_sliding_window is on: the mapping pins it off, "
                                   "so transformers slides none whatever this says (layer_types, when given, is "
                                   "the window knob's)"}
       for arch in ("Qwen2ForCausalLM", "Qwen3ForCausalLM", "Qwen2MoeForCausalLM")},
    "Llama4ForCausalLM": {
        **dict.fromkeys(["interleave_moe_layer_step", "moe_layers"],
                        "which layers are MoE: an MoE layer's tensors (feed_forward.experts.*, router) and a dense "
                        "layer's (feed_forward.gate_proj...) differ, so a checkpoint whose MoE layers are elsewhere "
                        "is refused by the tensor check"),
    },
}
BY_ARCHITECTURE["Qwen2MoeForCausalLM"]["intermediate_size"] = (
    "the dense MLP of layers outside decoder_sparse_step / mlp_only_layers, which the mapping pins to none")

# The rope variants the walk also reads the knobs under: the lengths YaRN and LongRoPE derive their
# factors from when rope_parameters gives none (a rotary family's max_position_embeddings,
# Phi-3's top-level original_max_position_embeddings)
SCALED_ROPES = ({"rope_type": "yarn", "rope_theta": 10000.0},
                {"rope_type": "longrope", "rope_theta": 10000.0, "short_factor": [1.0], "long_factor": [1.0]})


class _Reads(dict):
    """A config whose keys record being read (get, [], in, items, values), nested dicts with their
    parent's name as a prefix."""

    def __init__(self, config: dict, seen: set, prefix: str = ""):
        super().__init__({k: _Reads(v, seen, f"{prefix}{k}.") if isinstance(v, dict) else v for k, v in config.items()})
        self._seen, self._prefix = seen, prefix

    def _read(self, key):
        self._seen.add(f"{self._prefix}{key}")

    def get(self, key, default=None):
        self._read(key)
        return super().get(key, default)

    def __getitem__(self, key):
        self._read(key)
        return super().__getitem__(key)

    def __contains__(self, key):
        self._read(key)
        return super().__contains__(key)

    def items(self):
        for key in self:
            self._read(key)
        return super().items()

    def values(self):
        for key in self:
            self._read(key)
        return super().values()


def _specs() -> list:
    from specc.frontend.load import load_spec

    out = []
    for path in sorted(glob.glob(os.path.join(ROOT, "specs", "*.yaml"))):
        if not path.endswith("-tiny.yaml"):
            spec = load_spec(path)
            if spec.hf and spec.hf.get("params"):
                out.append(os.path.basename(path))
    return out


SPECS = _specs()


def _knobs(spec) -> list:
    """The knobs import checks for this spec: those of the op kinds it uses, and every `any` knob."""
    from specc.frontend.model import Leaf
    from specc.ops import OPS

    kinds = {leaf.op for module in spec.modules.values() for leaf in module.submodules.values()
             if isinstance(leaf, Leaf)}
    return [knob for kind in OPS.values() for knob in kind.hf_knobs() if kind.name in kinds or knob.any]


def _read_by(knobs: list, config: dict) -> set:
    """The keys the knobs read in `config`, in it with each key they read removed (recursively: an
    older file's spelling), and with its rope scaled (SCALED_ROPES)."""
    seen, todo, tried = set(), [config], 0
    todo += [{**config, "rope_parameters": rope} for rope in SCALED_ROPES if "rope_parameters" in config]
    while todo:
        current, tried = todo.pop(), tried + 1
        assert tried < 500, "the walk does not end"
        now = set()
        reads = _Reads(current, now)
        for knob in knobs:
            knob.requested(reads, 4)
        todo += [{k: v for k, v in current.items() if k != key} for key in sorted(now - seen) if key in current]
        seen |= now
    return seen


def _flat(config: dict, prefix: str = "") -> list:
    out = []
    for key, value in config.items():
        out.append(f"{prefix}{key}")
        if isinstance(value, dict) and key not in ("id2label", "label2id", "rope_parameters"):
            out += _flat(value, f"{prefix}{key}.")
    return out


def _walk(name: str) -> tuple:
    """(architecture, {key: how it is owned, pinned or why it changes no math}, [unaccounted keys])."""
    import transformers

    from specc.frontend.load import load_spec
    from specc_torch.hf.mapping import mapping_of

    spec = load_spec(os.path.join(ROOT, "specs", name))
    mapping = mapping_of(spec)
    config = json.loads(getattr(transformers, mapping.architecture).config_class().to_json_string(use_diff=False))
    read = _read_by(_knobs(spec), config)
    pinned = set(_flat({**mapping.config, **mapping.import_config, **mapping.import_defaults}))
    pinned |= {mapping.layer_types[0]} if mapping.layer_types else set()
    ours = BY_ARCHITECTURE.get(mapping.architecture, {})
    how, missing = {}, []
    for key in _flat(config):
        last = key.rsplit(".", 1)[-1]
        if key in read:
            how[key] = "owned"
        elif key in pinned:
            how[key] = "pinned"
        elif key in ours or last in NOT_MATH:
            how[key] = ours.get(key) or NOT_MATH[last]
        else:
            missing.append(key)
    return mapping.architecture, how, missing


@pytest.mark.parametrize("name", SPECS)
def test_every_config_key_is_owned_by_an_op_pinned_by_the_mapping_or_changes_no_math(name):
    architecture, _, missing = _walk(name)
    assert not missing, (f"specs/{name} ({architecture}): config keys neither read by an op's HFKnob, pinned by "
                         f"the mapping, nor listed with a reason here: {missing}")


def test_the_walk_covers_the_families_and_its_reasons_are_used():
    """The families of issue 27 are walked, and every reason above is needed by some shipped
    family (a key that became owned or pinned is taken off the list)."""
    assert {"deepseek-v3.yaml", "nemotron-h.yaml", "bloom.yaml", "cohere-plus.yaml", "opt.yaml", "mpt.yaml",
            "llama.yaml", "gpt.yaml", "bert.yaml"} <= set(SPECS)
    walked = [_walk(name) for name in SPECS]
    used = {(arch, key.rsplit(".", 1)[-1]) for arch, how, _ in walked for key, why in how.items()
            if why not in ("owned", "pinned")}
    shipped = {arch for arch, _, _ in walked}
    stale = [(arch, key) for arch, keys in BY_ARCHITECTURE.items() if arch in shipped
             for key in keys if (arch, key) not in used]
    stale += [key for key in NOT_MATH if not any(k == key for _, k in used)]
    assert not stale, f"reasons no shipped family needs (the key is owned or pinned now, or gone): {stale}"


def test_the_walk_sees_what_the_ops_own():
    """The walk's notion of owned is what import checks: MPT's clip_qkv and softmax_scale by the
    clamp and attention ops, the rope lengths under YaRN and LongRoPE, use_sliding_window in a file
    without layer_types; and a key no op reads (a made-up one) is reported."""
    import transformers

    _, how, _ = _walk("mpt.yaml")
    assert how["attn_config.clip_qkv"] == how["attn_config.softmax_scale"] == how["attn_config.alibi"] == "owned"
    _, how, _ = _walk("phi3.yaml")
    assert how["max_position_embeddings"] == how["original_max_position_embeddings"] == "owned"
    _, how, _ = _walk("qwen2.yaml")
    assert how["use_sliding_window"] == "owned"
    original = transformers.LlamaConfig.to_json_string

    def with_a_new_key(self, use_diff=True):
        return json.dumps({**json.loads(original(self, use_diff=use_diff)), "attention_multiplier": 0.5})

    try:
        transformers.LlamaConfig.to_json_string = with_a_new_key
        assert _walk("llama.yaml")[2] == ["attention_multiplier"]
    finally:
        transformers.LlamaConfig.to_json_string = original
