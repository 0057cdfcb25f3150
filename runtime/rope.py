"""Rotary position embedding (RoPE) and its frequency scalings: linear, Llama 3's, YaRN and
LongRoPE, each computed as transformers computes it (modeling_rope_utils), so a checkpoint
trained with one imports with the same angles. General on purpose: any attention that rotates
(multi-head, grouped-query, multi-latent's rope heads) builds its RotaryEmbedding from here.

YaRN and LongRoPE also scale cos and sin by an attention factor (transformers' `attention_scaling`,
YaRN's mscale): the scores q.k of the rotated features grow by its square."""

from __future__ import annotations

import math

import torch
from torch import nn

from .context_parallel import load_balanced_positions
from .parallel_state import Group

ROPE_SCALINGS = ("none", "linear", "llama3", "yarn", "longrope")


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's attention temperature 0.1 * mscale * ln(factor) + 1 (1 for factor <= 1)."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def rope_attention_factor(scaling: str, factor: float = 1.0, original_max_positions: int = 8192,
                          attention_factor: float | None = None, mscale: float | None = None,
                          mscale_all_dim: float | None = None) -> float:
    """What cos and sin are multiplied by: `attention_factor` when given; else for yarn
    mscale(factor, mscale) / mscale(factor, mscale_all_dim) when both are given (DeepSeek),
    mscale(factor) otherwise; for longrope sqrt(1 + ln(factor) / ln(original_max_positions))
    (factor > 1); 1 for the others."""
    if attention_factor is not None:
        return float(attention_factor)
    if scaling == "yarn":
        if mscale and mscale_all_dim:
            return float(yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all_dim))
        return yarn_mscale(factor)
    if scaling == "longrope" and factor > 1.0:
        return math.sqrt(1 + math.log(factor) / math.log(original_max_positions))
    return 1.0


def _yarn_inv_freq(dim: int, base: float, factor: float, original_max_positions: int, beta_fast: float,
                   beta_slow: float, truncate: bool) -> torch.Tensor:
    """transformers' _compute_yarn_parameters, in its float32 arithmetic: the frequencies whose
    wavelengths fit in the original context many times (above beta_fast rotations) keep their
    value, the long ones (below beta_slow) are divided by factor, a linear ramp between."""
    def correction_dim(rotations):
        return (dim * math.log(original_max_positions / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # transformers' guard against a zero-width ramp
    pos_freqs = base ** (torch.arange(0, dim, 2).to(dtype=torch.float) / dim)
    extrapolation, interpolation = 1.0 / pos_freqs, 1.0 / (factor * pos_freqs)
    keep = 1 - torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    return interpolation * (1 - keep) + extrapolation * keep


def rope_inv_freq(rotary_dim: int, base: float, scaling: str = "none", factor: float = 1.0,
                  low_freq_factor: float = 1.0, high_freq_factor: float = 4.0,
                  original_max_positions: int = 8192, *, beta_fast: float = 32.0, beta_slow: float = 1.0,
                  truncate: bool = True, ext_factors=None) -> torch.Tensor:
    """The rotary inverse frequencies [rotary_dim / 2] (float32). "linear" divides them by
    `factor` (positions interpolated); "llama3" divides the low frequencies (wavelength above
    original_max_positions / low_freq_factor) by `factor`, keeps the high ones (below
    original_max_positions / high_freq_factor) and interpolates smoothly between, as Llama 3.1 does;
    "yarn" ramps between the two by rotations in the original context (_yarn_inv_freq);
    "longrope" divides frequency i by ext_factors[i] (Phi-3's short or long factors)."""
    if scaling not in ROPE_SCALINGS:
        raise ValueError(f"rope scaling must be one of {ROPE_SCALINGS}, got {scaling!r}")
    if scaling == "yarn":
        return _yarn_inv_freq(rotary_dim, base, factor, original_max_positions, beta_fast, beta_slow, truncate)
    if scaling == "longrope":
        if ext_factors is None or len(ext_factors) != rotary_dim // 2:
            raise ValueError(f"longrope needs {rotary_dim // 2} factors (one per frequency), got "
                             f"{None if ext_factors is None else len(ext_factors)}")
        shape = torch.arange(0, rotary_dim, 2, dtype=torch.int64).float() / rotary_dim
        return 1.0 / (torch.tensor(ext_factors, dtype=torch.float32) * base ** shape)
    inv_freq = 1.0 / (base ** (torch.arange(0, rotary_dim, 2, dtype=torch.float64) / rotary_dim))
    if scaling == "linear":
        inv_freq = inv_freq / factor
    elif scaling == "llama3":
        if high_freq_factor < low_freq_factor:
            raise ValueError(f"llama3 rope scaling needs high_freq_factor >= low_freq_factor, got "
                             f"{high_freq_factor} and {low_freq_factor}")
        wavelen = 2 * math.pi / inv_freq
        low_wavelen, high_wavelen = original_max_positions / low_freq_factor, original_max_positions / high_freq_factor
        scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
        if high_freq_factor == low_freq_factor:  # a step (Llama 4 Scout): nothing between to smooth
            return scaled.float()
        smooth = (original_max_positions / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        inv_freq = torch.where(medium, smoothed, scaled)
    return inv_freq.float()


class RotaryEmbedding(nn.Module):
    """Rotary position embedding over the first `rotary_dim` features of each head (all of it by
    default; GPT-NeoX and Phi rotate a fraction and pass the rest through).

    `interleaved=False` (rotate-half, HF Llama/NeoX): feature f pairs with f + rotary_dim/2;
    `interleaved=True` (GPT-J, Megatron's rotary_interleaved): features 2i and 2i+1 pair.
    forward(x [s, b, n*d]) rotates every head of size head_dim at positions 0..s-1; with a
    context-parallel `cp` of size N > 1, at the global positions of this rank's load-balanced
    chunks of the N*s sequence (load_balanced_positions). Frequency scaling: rope_inv_freq; cos
    and sin times rope_attention_factor. LongRoPE picks its long factors when the whole sequence
    (N*s tokens) is longer than original_max_positions, its short ones otherwise, as transformers
    does by the largest position.
    """

    def __init__(self, head_dim: int, base: float = 10000.0, *, cp: Group | None = None,
                 rotary_dim: int | None = None, interleaved: bool = False, scaling: str = "none",
                 factor: float = 1.0, low_freq_factor: float = 1.0, high_freq_factor: float = 4.0,
                 original_max_positions: int = 8192, beta_fast: float = 32.0, beta_slow: float = 1.0,
                 truncate: bool = True, attention_factor: float | None = None, mscale: float | None = None,
                 mscale_all_dim: float | None = None, short_factor=None, long_factor=None):
        super().__init__()
        rotary_dim = head_dim if rotary_dim is None else rotary_dim
        if rotary_dim % 2 != 0 or not 2 <= rotary_dim <= head_dim:
            raise ValueError(f"rotary_dim must be even and in [2, head_dim={head_dim}], got {rotary_dim}")
        self.head_dim, self.rotary_dim, self.base, self.cp = head_dim, rotary_dim, base, cp
        self.interleaved, self.scaling, self.original_max_positions = interleaved, scaling, original_max_positions
        self.attention_factor = rope_attention_factor(scaling, factor, original_max_positions, attention_factor,
                                                      mscale, mscale_all_dim)
        kw = dict(beta_fast=beta_fast, beta_slow=beta_slow, truncate=truncate)
        freqs = [rope_inv_freq(rotary_dim, base, scaling, factor, low_freq_factor, high_freq_factor,
                               original_max_positions, ext_factors=ext, **kw)
                 for ext in ((short_factor, long_factor) if scaling == "longrope" else (None,))]
        self.register_buffer("inv_freq", freqs[0], persistent=False)
        self.register_buffer("long_inv_freq", freqs[-1] if scaling == "longrope" else None, persistent=False)
        self._cache: tuple | None = None  # (seq_len, device, dtype, frequencies, cos, sin)

    def _cos_sin(self, s: int, device, dtype, inv_freq):
        cache = self._cache
        if cache is None or cache[0] < s or cache[1] != device or cache[2] != dtype or cache[3] is not inv_freq:
            positions = torch.arange(s, device=device, dtype=torch.float32)
            freqs = torch.outer(positions, inv_freq.to(device))
            # rotate-half: [f0 .. f_{r/2-1}, f0 .. f_{r/2-1}]; interleaved: [f0, f0, f1, f1, ...]
            angles = freqs.repeat_interleave(2, dim=-1) if self.interleaved else torch.cat([freqs, freqs], dim=-1)
            f = self.attention_factor
            cache = (s, device, dtype, inv_freq, (angles.cos() * f).to(dtype), (angles.sin() * f).to(dtype))
            self._cache = cache
        return cache[4][:s], cache[5][:s]

    def forward(self, x: torch.Tensor, position_ids: torch.Tensor | None = None) -> torch.Tensor:
        """position_ids [b, S] (int; S the whole sequence, also under context parallelism): each
        token's position, e.g. within its packed document (Megatron's --reset-position-ids);
        default 0..S-1 for every sample."""
        s, b, width = x.shape
        if width % self.head_dim != 0:
            raise ValueError(f"last dim {width} is not a multiple of head_dim {self.head_dim}")
        heads = x.reshape(s, b, width // self.head_dim, self.head_dim)
        n = self.cp.size if self.cp is not None else 1
        long = self.long_inv_freq is not None and s * n > self.original_max_positions
        inv_freq = self.long_inv_freq if long else self.inv_freq
        if position_ids is not None:
            if tuple(position_ids.shape) != (b, s * n):
                raise ValueError(f"position_ids must be [b, s] = [{b}, {s * n}] (the whole sequence's, also under "
                                 f"context parallelism), got {tuple(position_ids.shape)}")
            if n > 1:
                position_ids = position_ids.index_select(1, load_balanced_positions(s, self.cp, x.device))
            # [s, b, rotary_dim]: the angles as _cos_sin computes its table (the same fp32 products),
            # per token; no table lookup, so no position is read back to the host
            freqs = position_ids.t().to(x.device, torch.float32)[..., None] * inv_freq.to(x.device)
            angles = freqs.repeat_interleave(2, dim=-1) if self.interleaved else torch.cat([freqs, freqs], dim=-1)
            f = self.attention_factor
            cos, sin = (angles.cos() * f).to(x.dtype)[:, :, None, :], (angles.sin() * f).to(x.dtype)[:, :, None, :]
        elif n > 1:
            cos, sin = self._cos_sin(s * n, x.device, x.dtype, inv_freq)
            positions = load_balanced_positions(s, self.cp, x.device)
            cos, sin = cos.index_select(0, positions)[:, None, None, :], sin.index_select(0, positions)[:, None, None, :]
        else:
            cos, sin = self._cos_sin(s, x.device, x.dtype, inv_freq)
            cos, sin = cos[:, None, None, :], sin[:, None, None, :]
        rot, rest = heads[..., :self.rotary_dim], heads[..., self.rotary_dim:]
        if self.interleaved:
            pairs = rot.reshape(*rot.shape[:-1], self.rotary_dim // 2, 2)
            rotated = torch.stack([-pairs[..., 1], pairs[..., 0]], dim=-1).reshape(rot.shape)
        else:
            first, second = rot.chunk(2, dim=-1)
            rotated = torch.cat([-second, first], dim=-1)
        out = rot * cos + rotated * sin
        if self.rotary_dim < self.head_dim:
            out = torch.cat([out, rest], dim=-1)
        return out.reshape(s, b, width)

    def extra_repr(self) -> str:
        return (f"head_dim={self.head_dim}, rotary_dim={self.rotary_dim}, base={self.base}, "
                f"interleaved={self.interleaved}, scaling={self.scaling}"
                + (f", attention_factor={self.attention_factor}" if self.attention_factor != 1.0 else ""))


class AttentionTemperature(nn.Module):
    """Llama 4's attention temperature tuning (transformers' attn_temperature_tuning, on its layers
    without rope): each query at global position p is multiplied by
    log(floor((p + 1) / floor_scale) + 1) * attn_scale + 1, in fp32, then cast back (as
    transformers does). forward(q [s, b, width]) at positions 0..s-1, or with a context-parallel
    `cp` of size N > 1 at the global positions of this rank's load-balanced chunks."""

    def __init__(self, floor_scale: float, attn_scale: float, *, cp: Group | None = None):
        super().__init__()
        if floor_scale <= 0:
            raise ValueError(f"floor_scale must be positive, got {floor_scale}")
        self.floor_scale, self.attn_scale, self.cp = float(floor_scale), float(attn_scale), cp

    def scales(self, s: int, device) -> torch.Tensor:
        """[s] fp32: the factor of each of this rank's s positions."""
        n = self.cp.size if self.cp is not None else 1
        positions = load_balanced_positions(s, self.cp, device) if n > 1 else torch.arange(s, device=device)
        return torch.log1p(torch.floor((positions.float() + 1.0) / self.floor_scale)) * self.attn_scale + 1.0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (x * self.scales(x.shape[0], x.device).view(-1, *([1] * (x.dim() - 1)))).to(x.dtype)

    def extra_repr(self) -> str:
        return f"floor_scale={self.floor_scale}, attn_scale={self.attn_scale}"
