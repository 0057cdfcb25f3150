"""Core attention: softmax(q k^T / sqrt(d)) v over LOCAL heads, with backends.

Inputs are sequence-first [s, b, heads * head_dim]; head counts are per rank
(already divided by the tensor-parallel size), so no communication happens here.
Dropout runs on the "tensor-parallel" RNG stream: each rank owns different heads.
With a context-parallel group `cp` of size > 1 the inputs are this rank's load-balanced
sequence chunks and attention runs over the whole sequence through
runtime.context_parallel (comm type "p2p" ring or "all_gather"; backends sdpa and unfused),
with the same window, soft-cap and document masks by global position (document ids stay the
whole sequence's [b, S]).

ALiBi (BLOOM, MPT; `alibi_max_bias`): slope_h * (j - i) added to the scaled scores, slope_h by
the GLOBAL query head index (this rank's heads are tp.rank * num_heads onwards), so every TP and
CP layout adds what one device adds. Chunked attention (Llama 4; `chunk`): a query sees only the
keys of its own chunk of `chunk` positions.
"""

from __future__ import annotations

import contextlib
import math

import torch
import torch.nn.functional as F
from torch import nn

from .context_parallel import COMM_TYPES, context_parallel_attention
from .parallel_state import Group
from .random import RNGTracker
from .sharding import local_piece

_BACKENDS = ("sdpa", "unfused", "flash", "te")


class CoreAttention(nn.Module):
    def __init__(
        self,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        *,
        causal: bool = True,
        dropout: float = 0.0,
        backend: str = "sdpa",
        rng_tracker: RNGTracker | None = None,
        tp: Group | None = None,
        cp: Group | None = None,
        cp_comm_type: str = "p2p",
        window: int | None = None,
        scale: float | None = None,
        softcap: float | None = None,
        chunk: int | None = None,
        alibi_max_bias: float | None = None,
        v_head_dim: int | None = None,
    ):
        super().__init__()
        self.tp = tp or Group.single("tp")  # only the TP-invariant dropout mode needs it
        self.cp, self.cp_comm_type = cp or Group.single("cp"), cp_comm_type
        if backend not in _BACKENDS:
            raise ValueError(f"attention backend must be one of {_BACKENDS}, got {backend!r}")
        if cp_comm_type not in COMM_TYPES:
            raise ValueError(f"cp_comm_type must be one of {COMM_TYPES}, got {cp_comm_type!r}")
        if self.cp.size > 1 and backend not in ("sdpa", "unfused"):
            raise ValueError(f"context parallelism (cp={self.cp.size}) runs the runtime's own attention: "
                             f"use backend 'sdpa' or 'unfused', not {backend!r}")
        if num_heads % num_kv_heads != 0:
            raise ValueError(f"num_heads ({num_heads}) must be a multiple of num_kv_heads ({num_kv_heads})")
        if window is not None and window < 1:
            raise ValueError(f"attention window must be >= 1 token, got {window}")
        if softcap is not None and softcap <= 0:
            raise ValueError(f"attention softcap must be > 0, got {softcap}")
        if chunk is not None and chunk < 1:
            raise ValueError(f"attention chunk must be >= 1 token, got {chunk}")
        if backend in ("flash", "te") and any(x is not None for x in (window, softcap, scale, chunk, alibi_max_bias)):
            raise ValueError(f"backend {backend!r} is not wired for a window, chunks, ALiBi, soft-cap or custom "
                             "scale; use 'sdpa'")
        self.chunk, self.alibi_max_bias = chunk, alibi_max_bias
        slopes = None  # ALiBi: this rank's heads' slopes, of all num_heads * tp.size heads
        if alibi_max_bias is not None:
            slopes = alibi_slopes(num_heads * self.tp.size, alibi_max_bias)
            slopes = slopes[self.tp.rank * num_heads:(self.tp.rank + 1) * num_heads]
        self.register_buffer("alibi", slopes, persistent=False)
        self.v_head_dim = v_head_dim or head_dim  # MLA: values narrower than the q/k heads
        if self.v_head_dim != head_dim and (backend in ("flash", "te") or self.cp.size > 1):
            raise ValueError(f"v_head_dim={self.v_head_dim} apart from head_dim={head_dim} needs the sdpa or unfused "
                             f"backend without context parallelism")
        self.window, self.softcap = window, softcap
        self.scale = 1.0 / math.sqrt(head_dim) if scale is None else float(scale)
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.causal, self.dropout, self.backend = causal, dropout, backend
        self.rng_tracker = rng_tracker
        self._flash_attn_func = _import_flash_attn() if backend == "flash" else None
        self.te_attention = self._build_te() if backend == "te" else None

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                document_ids: torch.Tensor | None = None) -> torch.Tensor:
        """`document_ids` [b, s] (any integers): a token attends only to tokens of its own
        document, so packed documents or padding (give pads their own id) do not mix."""
        s, b = q.shape[0], q.shape[1]
        if document_ids is not None and self.backend in ("flash", "te"):
            raise ValueError("document ids (a padding mask) need the sdpa or unfused backend")
        if document_ids is not None and tuple(document_ids.shape) != (b, s * self.cp.size):
            raise ValueError(f"document_ids must be [b, s] = [{b}, {s * self.cp.size}] (the whole sequence's, "
                             f"also under context parallelism), got {tuple(document_ids.shape)}")
        q4 = _heads(q, self.num_heads, self.head_dim, "q")
        k4 = _heads(k, self.num_kv_heads, self.head_dim, "k")
        v4 = _heads(v, self.num_kv_heads, self.v_head_dim, "v")
        p = self.dropout if self.training else 0.0
        fork = self.rng_tracker.fork("tensor-parallel") if p > 0 and self.rng_tracker else contextlib.nullcontext()
        with fork:
            if self.cp.size > 1:
                return context_parallel_attention(
                    q, k, v, num_heads=self.num_heads, num_kv_heads=self.num_kv_heads, head_dim=self.head_dim,
                    cp=self.cp, comm_type=self.cp_comm_type, causal=self.causal, dropout_p=p, softmax_scale=self.scale,
                    rng_tracker=self.rng_tracker, tp=self.tp, window=self.window, softcap=self.softcap,
                    document_ids=document_ids, chunk=self.chunk, alibi_slopes=self.alibi)
            if self.backend == "te":
                return self.te_attention(q4, k4, v4)  # sbhd in, [s, b, nh * d] out
            if self.backend == "flash":
                out = self._flash_attn_func(q4.transpose(0, 1), k4.transpose(0, 1), v4.transpose(0, 1),
                                            dropout_p=p, causal=self.causal)
                return out.transpose(0, 1).reshape(s, b, self.num_heads * self.head_dim)
            out = self._torch_attention(q4, k4, v4, p, document_ids)  # [b, nh, s, d]
        return out.permute(2, 0, 1, 3).reshape(s, b, self.num_heads * self.v_head_dim)

    def _allowed(self, sq: int, sk: int, document_ids, device) -> torch.Tensor | None:
        """Which keys each query may see ([b or 1, 1, sq, sk], True: attend), or None for all of
        them. A window of w keeps the w most recent keys, the query's own included (HF's
        sliding_window); without a causal mask it reaches w - 1 tokens each way."""
        if not (self.causal or self.window is not None or self.chunk is not None or document_ids is not None):
            return None
        qi = torch.arange(sq, device=device)[:, None]
        kj = torch.arange(sk, device=device)[None, :]
        allowed = torch.ones(sq, sk, dtype=torch.bool, device=device)
        if self.causal:
            allowed &= kj <= qi
        if self.window is not None:
            allowed &= (qi - kj).abs() < self.window
        if self.chunk is not None:
            allowed &= qi // self.chunk == kj // self.chunk
        allowed = allowed[None, None]
        if document_ids is not None:
            allowed = allowed & (document_ids[:, None, :, None] == document_ids[:, None, None, :])
        return allowed

    def _torch_attention(self, q4, k4, v4, p: float, document_ids=None) -> torch.Tensor:
        # [s, b, n, d] -> [b, n, s, d]; each kv head serves num_heads/num_kv_heads
        # consecutive query heads (repeat_interleave, as in HF Llama).
        group = self.num_heads // self.num_kv_heads
        q, k, v = (t.permute(1, 2, 0, 3) for t in (q4, k4, v4))
        invariant = p > 0 and self.rng_tracker is not None and self.rng_tracker.tp_invariant
        plain = self.window is None and self.chunk is None and self.alibi is None and document_ids is None
        # SDPA draws its own dropout mask (the debug mode needs ours) and cannot soft-cap scores
        if self.backend == "sdpa" and not invariant and self.softcap is None:
            # SDPA groups query heads over kv heads itself: no repeated copies of k and v are kept
            if plain:
                return F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=self.causal, scale=self.scale,
                                                      enable_gqa=group > 1)
            allowed = self._allowed(q.shape[2], k.shape[2], document_ids, q.device)
            if self.alibi is not None:  # a float mask: the bias, -inf where not allowed
                bias = self._alibi_bias(q.shape[2], k.shape[2], q.dtype, q.device)
                allowed = bias if allowed is None else bias.masked_fill(~allowed, float("-inf"))
            return F.scaled_dot_product_attention(q, k, v, attn_mask=allowed, dropout_p=p, scale=self.scale,
                                                  enable_gqa=group > 1)
        if group > 1:
            k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        return self._unfused(q, k, v, p, document_ids)

    def _alibi_bias(self, sq: int, sk: int, dtype, device) -> torch.Tensor:
        """[1, heads, sq, sk]: slope_h * (j - i). BLOOM adds slope_h * j; softmax does not see the
        difference (a constant per row), and j - i stays small where j does not."""
        diff = torch.arange(sk, device=device)[None, :] - torch.arange(sq, device=device)[:, None]
        return (self.alibi.to(device, dtype)[:, None, None] * diff.to(dtype))[None]

    def _invariant_keep(self, probs: torch.Tensor, p: float) -> torch.Tensor:
        """TP-invariant debug mode: the mask over all heads, this rank's heads kept."""
        b, n, sq, sk = probs.shape
        full = self.rng_tracker.full_keep_mask((b, n * self.tp.size, sq, sk), p, probs.device)
        return local_piece(full, "S(h)", self.tp, dim_for_heads=1)

    def _unfused(self, q, k, v, p: float, document_ids=None) -> torch.Tensor:
        # Megatron's local path: explicit scores, (soft-capped,) masked, fp32 softmax, dropout.
        scores = torch.matmul(q, k.transpose(-1, -2)) * self.scale
        if self.softcap is not None:  # Gemma 2: softcap * tanh(scores / softcap), before the mask
            scores = torch.tanh(scores / self.softcap) * self.softcap
        if self.alibi is not None:
            scores = scores + self._alibi_bias(scores.shape[-2], scores.shape[-1], scores.dtype, scores.device)
        allowed = self._allowed(scores.shape[-2], scores.shape[-1], document_ids, scores.device)
        if allowed is not None:
            scores = scores.masked_fill(~allowed, float("-inf"))
        probs = torch.softmax(scores.to(_at_least_fp32(scores.dtype)), dim=-1).to(q.dtype)
        if p > 0 and self.rng_tracker is not None and self.rng_tracker.tp_invariant:
            probs = probs * self._invariant_keep(probs, p).to(probs.dtype) / (1.0 - p)
        elif p > 0:
            probs = F.dropout(probs, p, training=True)
        return torch.matmul(probs, v)

    def _build_te(self) -> nn.Module:
        te = _import_transformer_engine()
        return te.DotProductAttention(
            num_attention_heads=self.num_heads,
            kv_channels=self.head_dim,
            num_gqa_groups=self.num_kv_heads,
            attention_dropout=self.dropout,
            qkv_format="sbhd",
            attn_mask_type="causal" if self.causal else "no_mask",
        )

    def extra_repr(self) -> str:
        return (f"heads={self.num_heads}, kv_heads={self.num_kv_heads}, head_dim={self.head_dim}, "
                f"causal={self.causal}, dropout={self.dropout}, backend={self.backend}"
                + (f", v_head_dim={self.v_head_dim}" if self.v_head_dim != self.head_dim else "")
                + (f", window={self.window}" if self.window is not None else "")
                + (f", scale={self.scale}" if self.scale != 1.0 / math.sqrt(self.head_dim) else "")
                + (f", softcap={self.softcap}" if self.softcap is not None else "")
                + (f", chunk={self.chunk}" if self.chunk is not None else "")
                + (f", alibi_max_bias={self.alibi_max_bias}" if self.alibi is not None else "")
                + (f", cp={self.cp.size}, cp_comm_type={self.cp_comm_type}" if self.cp.size > 1 else ""))


def alibi_slopes(num_heads: int, max_bias: float = 8.0) -> torch.Tensor:
    """ALiBi's per-head slopes (float32, [num_heads]): 2^(-max_bias * k / n) for k = 1..n with n
    a power of two; otherwise the next power of two's, those of even k first, then those of odd k
    (MPT's gen_slopes; with max_bias 8 exactly BLOOM's _get_alibi_slopes)."""
    n = 2 ** math.ceil(math.log2(num_heads))
    slopes = 2.0 ** (-torch.arange(1, n + 1, dtype=torch.float64) * (max_bias / n))
    if n != num_heads:
        slopes = torch.cat([slopes[1::2], slopes[::2]])[:num_heads]
    return slopes.float()


def _at_least_fp32(dtype: torch.dtype) -> torch.dtype:
    return torch.promote_types(dtype, torch.float32)


def _heads(x: torch.Tensor, n: int, d: int, what: str) -> torch.Tensor:
    if x.dim() != 3 or x.shape[-1] != n * d:
        raise ValueError(f"{what} must be [s, b, {n}*{d}={n * d}], got {tuple(x.shape)}")
    return x.reshape(x.shape[0], x.shape[1], n, d)


def _import_flash_attn():
    try:
        from flash_attn import flash_attn_func
    except ImportError as e:
        raise ImportError(
            "CoreAttention(backend='flash') needs the flash-attn package (and a CUDA GPU), "
            "which is not installed here; install flash-attn or use backend='sdpa'"
        ) from e
    return flash_attn_func


def _import_transformer_engine():
    try:
        import transformer_engine.pytorch as te
    except ImportError as e:
        raise ImportError(
            "CoreAttention(backend='te') needs NVIDIA TransformerEngine (transformer_engine.pytorch, "
            "and a CUDA GPU), which is not installed here; install it or use backend='sdpa'"
        ) from e
    return te
