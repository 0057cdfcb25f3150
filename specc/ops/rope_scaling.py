"""The rotary op's YaRN and LongRoPE scalings as transformers derives them from a config
(modeling_rope_utils: _compute_yarn_parameters, _compute_longrope_parameters), without torch: the
HF knobs compare a checkpoint's rope settings with what a rotary op computes, and the emitter
passes the attention factor it computes here to runtime.RotaryEmbedding."""

from __future__ import annotations

import math

SCALINGS = ("linear", "llama3", "yarn", "longrope")  # the rope types with a `factor`
EXTENDING = ("yarn", "longrope")  # those that also scale cos and sin (an attention factor)


def _number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def hf_original(rope: dict, config: dict):
    value = rope.get("original_max_position_embeddings", config.get("original_max_position_embeddings"))
    return value if _number(value) and value > 0 else None


def hf_factor(rope: dict, config: dict):
    """The factor transformers uses: rope's own, else (YaRN, LongRoPE) max_position_embeddings /
    original_max_position_embeddings; a string naming what is missing when it cannot be derived
    (no op models that)."""
    factor = rope.get("factor")
    if factor is not None or rope.get("rope_type") not in EXTENDING:
        return factor
    longest, original = config.get("max_position_embeddings"), hf_original(rope, config)
    if not _number(longest) or original is None:
        return "no factor, and no max_position_embeddings / original_max_position_embeddings to derive it"
    return longest / original


def mscale(factor: float, scale: float = 1.0) -> float:
    """YaRN's attention temperature 0.1 * scale * ln(factor) + 1 (1 for factor <= 1)."""
    return 1.0 if factor <= 1 else 0.1 * scale * math.log(factor) + 1.0


def attention_factor(kind: str, factor: float, original: int, given=None, scale=None, scale_all_dim=None) -> float:
    """What cos and sin are multiplied by: `given` when set; YaRN: mscale(factor, scale) /
    mscale(factor, scale_all_dim) when both are set (DeepSeek), else mscale(factor); LongRoPE:
    sqrt(1 + ln(factor) / ln(original)) for a factor above 1."""
    if given is not None:
        return float(given)
    if kind == "yarn":
        return mscale(factor, scale) / mscale(factor, scale_all_dim) if scale and scale_all_dim else mscale(factor)
    if kind == "longrope" and factor > 1.0:
        return math.sqrt(1 + math.log(factor) / math.log(original))
    return 1.0


def hf_attention_factor(rope: dict, config: dict):
    """transformers' attention factor (attention_scaling) for a YaRN or LongRoPE config."""
    factor, original = hf_factor(rope, config), hf_original(rope, config)
    if not _number(factor) or original is None:
        return f"rope factor {factor!r} with original_max_position_embeddings {original!r}"
    return attention_factor(rope["rope_type"], factor, original, rope.get("attention_factor"), rope.get("mscale"),
                            rope.get("mscale_all_dim"))


def modeled_attention_factor(attrs: dict) -> float:
    return attention_factor(attrs["scaling"], attrs["factor"], attrs["original_max_positions"],
                            attrs.get("attention_factor"), attrs.get("mscale"), attrs.get("mscale_all_dim"))


def hf_yarn(key: str, default):
    """requested-value reader for a YaRN setting transformers defaults when absent or null
    (`beta_fast or 32`, `beta_slow or 1`, `truncate` True)."""
    def read(rope: dict, config: dict):
        value = rope.get(key)
        return default if value is None or (key != "truncate" and not value) else value
    return read


def hf_list(key: str):
    def read(rope: dict, config: dict):
        return rope.get(key)
    return read
