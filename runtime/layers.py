"""Tensor-parallel layers. Activations are sequence-first [s, b, h].

Parameters are created at their LOCAL shard shape (uninitialized) and tagged with
init metadata; runtime.init.init_parameters fills them TP-invariantly.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from . import comm
from .attention import CoreAttention
from .context_parallel import load_balanced_positions
from .init import check_segment, segment_piece, tag_parameter
from .mappings import gather_dim0
from .parallel_state import Group
from .random import RNGTracker
from .rope import ROPE_SCALINGS, RotaryEmbedding, rope_inv_freq  # noqa: F401 (moved there; imported from here)
from .sharding import local_piece

__all__ = [
    "ColumnParallelLinear",
    "RowParallelLinear",
    "VocabParallelEmbedding",
    "PositionEmbedding",
    "LayerNorm",
    "RMSNorm",
    "RotaryEmbedding",
    "CoreAttention",
    "Dropout",
]

_INPUT_MODES = ("none", "copy", "gather")


def _at_least_fp32(dtype: torch.dtype) -> torch.dtype:
    return torch.promote_types(dtype, torch.float32)


def _divide(n: int, d: int, what: str) -> int:
    if n % d != 0:
        raise ValueError(f"{what} ({n}) is not divisible by the tensor-parallel size {d}")
    return n // d


class _ColumnParallelLinearFn(torch.autograd.Function):
    """y = x W^T + b with the input boundary folded in (Megatron's
    LinearWithGradAccumulationAndAsyncCommunication idea):

    copy:   forward identity; backward all-reduces grad-input asynchronously while
            the weight-gradient GEMM runs.
    gather: forward all-gathers the [s/t, b, h] input on dim 0 but saves only the
            local shard; backward re-gathers it (overlapped with the grad-input GEMM)
            and reduce-scatters grad-input asynchronously during the wgrad GEMM.
    """

    @staticmethod
    def forward(ctx, x, weight, bias, tp, mode):
        total = gather_dim0(x, tp) if mode == "gather" else x
        ctx.save_for_backward(x, weight)
        ctx.tp, ctx.mode, ctx.has_bias = tp, mode, bias is not None
        ctx.bias_dtype = bias.dtype if bias is not None else None
        return F.linear(total, weight, bias)  # under autocast, casts all three alike

    @staticmethod
    def backward(ctx, grad_out):
        x, weight = ctx.saved_tensors
        tp, mode = ctx.tp, ctx.mode
        need_input, need_weight, need_bias = ctx.needs_input_grad[:3]

        total, gather_work = x, None
        if mode == "gather" and need_weight:
            total = x.new_empty((x.shape[0] * tp.size, *x.shape[1:]))
            gather_work = comm.all_gather_into_tensor(total, x.contiguous(), tp, async_op=True)

        # Backward runs outside autocast: bring the saved tensors to the gradient's
        # dtype for the GEMMs, and return each gradient in its input's dtype.
        compute = grad_out.dtype
        grad_input = grad_out.matmul(weight.to(compute)).to(x.dtype) if need_input else None
        if gather_work is not None:
            gather_work.wait()

        reduce_work = None
        if grad_input is not None and mode == "copy":
            reduce_work = comm.all_reduce(grad_input, tp, async_op=True)
        elif grad_input is not None and mode == "gather":
            full_grad_input = grad_input
            grad_input = full_grad_input.new_empty((x.shape[0], *full_grad_input.shape[1:]))
            reduce_work = comm.reduce_scatter_tensor(grad_input, full_grad_input, tp, async_op=True)

        grad_out_2d = grad_out.reshape(-1, grad_out.shape[-1])
        grad_weight = None
        if need_weight:
            total_2d = total.reshape(-1, total.shape[-1]).to(compute)
            grad_weight = grad_out_2d.t().matmul(total_2d).to(weight.dtype)
        grad_bias = grad_out_2d.sum(dim=0).to(ctx.bias_dtype) if ctx.has_bias and need_bias else None

        if reduce_work is not None:
            reduce_work.wait()
        return grad_input, grad_weight, grad_bias, None, None


class ColumnParallelLinear(nn.Module):
    """Weight [out/t, in] sharded on the output dim; output layout S(h).

    `segments` are FULL output sizes (e.g. [q, k, v] or [gate, up]); each is sharded
    on its own, so the local weight is [q/t | k/t | v/t] rather than a slice of the
    fused slab. `weight` shares an existing parameter (tied output layer).
    `replicated=True`: a plain linear (a spec's `parallel: none`) whose whole weight every
    rank holds; its parameters are recorded as replicated, whatever the TP size.
    `heads`: per segment, the attention heads it holds. A segment of fewer heads than TP ranks
    (grouped-query K/V) is not cut inside a head: each head is replicated over t / heads ranks,
    rank r holding head r // (t / heads); the replicas' weight gradients are partial (each sees
    only its own query heads) and finalize_model_grads sums them over TP.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        *,
        tp: Group,
        bias: bool = True,
        segments=None,
        input_mode: str = "none",
        init_std: float = 0.02,
        weight: nn.Parameter | None = None,
        replicated: bool = False,
        heads=None,
    ):
        super().__init__()
        if input_mode not in _INPUT_MODES:
            raise ValueError(f"input_mode must be one of {_INPUT_MODES}, got {input_mode!r}")
        if replicated and (tp.size != 1 or input_mode != "none"):
            raise ValueError("a replicated linear takes tp=Group.single('tp') and no input_mode")
        self.replicated = replicated
        segments = tuple(int(s) for s in (segments if segments is not None else [out_features]))
        if sum(segments) != out_features:
            raise ValueError(f"segments {list(segments)} sum to {sum(segments)}, not out_features={out_features}")
        heads = tuple(int(h) for h in heads) if heads is not None else (0,) * len(segments)
        if len(heads) != len(segments):
            raise ValueError(f"heads {list(heads)} name {len(heads)} segments, the linear has {len(segments)}")
        for size, n in zip(segments, heads):
            try:
                check_segment(size, n, tp.size)
            except ValueError as e:
                raise ValueError(f"output segment of size {size}: {e}") from None
        self.in_features, self.out_features = in_features, out_features
        self.tp, self.input_mode, self.segments = tp, input_mode, segments
        self.heads = heads if any(heads) else ()
        local_out = sum(segment_piece(size, n, tp.rank, tp.size)[1] for size, n in zip(segments, heads))
        shard = {} if replicated else {"shard_dim": 0, "segments": segments, "units": self.heads}

        if weight is None:
            self.weight = nn.Parameter(torch.empty(local_out, in_features))
            tag_parameter(self.weight, "normal", tp=tp, std=init_std, full_shape=(out_features, in_features), **shard)
        else:
            self._check_shared_weight(weight, local_out)
            self.weight = weight
        if bias:
            self.bias = nn.Parameter(torch.empty(local_out))
            tag_parameter(self.bias, "zeros", tp=tp, full_shape=(out_features,), **shard)
        else:
            self.register_parameter("bias", None)

    def _check_shared_weight(self, weight: nn.Parameter, local_out: int) -> None:
        if tuple(weight.shape) != (local_out, self.in_features):
            raise ValueError(
                f"shared weight has shape {tuple(weight.shape)}, expected {(local_out, self.in_features)} "
                f"(local shard of [{self.out_features}, {self.in_features}] at tp={self.tp.size})"
            )
        meta = getattr(weight, "_specc_init", None)
        if meta is not None and self.replicated and meta.shard_dim is not None:
            raise ValueError(f"shared weight is sharded on dim {meta.shard_dim}; a replicated linear needs a replicated one")
        if meta is not None and not self.replicated and (meta.shard_dim != 0 or meta.segments != self.segments
                                                         or meta.units != self.heads):
            raise ValueError(
                f"shared weight is sharded on dim {meta.shard_dim} with segments {list(meta.segments)}"
                f"{f' of heads {list(meta.units)}' if meta.units else ''}, "
                f"expected dim 0 with segments {list(self.segments)}"
                f"{f' of heads {list(self.heads)}' if self.heads else ''}"
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        mode = self.input_mode if self.tp.size > 1 else "none"
        if mode == "none":
            return F.linear(x, self.weight, self.bias)
        return _ColumnParallelLinearFn.apply(x, self.weight, self.bias, self.tp, mode)

    def extra_repr(self) -> str:
        return (f"in={self.in_features}, out={self.out_features}, tp={self.tp.size}, "
                f"segments={list(self.segments)}, input_mode={self.input_mode}"
                + (f", heads={list(self.heads)}" if self.heads else "")
                + (", replicated" if self.replicated else ""))


class RowParallelLinear(nn.Module):
    """Weight [out, in/t] sharded on the input dim; forward returns the partial
    product (layout P). The bias is full-size and NOT added here: the generated code
    adds it after the reduction boundary, so it is added once, not t times."""

    def __init__(self, in_features: int, out_features: int, *, tp: Group, bias: bool = True,
                 init_std: float = 0.02):
        super().__init__()
        local_in = _divide(in_features, tp.size, "in_features")
        self.in_features, self.out_features, self.tp = in_features, out_features, tp
        self.weight = nn.Parameter(torch.empty(out_features, local_in))
        tag_parameter(self.weight, "normal", tp=tp, std=init_std,
                      full_shape=(out_features, in_features), shard_dim=1)
        if bias:
            self.bias = nn.Parameter(torch.empty(out_features))
            tag_parameter(self.bias, "zeros")
        else:
            self.register_parameter("bias", None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight)

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, tp={self.tp.size}"


class VocabParallelEmbedding(nn.Module):
    """Weight [V/t, h]: rank r holds rows r*V/t .. (r+1)*V/t. forward(tokens [b, s])
    returns [s, b, h] partial sums (P): ids outside this rank's rows give zeros."""

    def __init__(self, num_embeddings: int, embedding_dim: int, *, tp: Group, init_std: float = 0.02,
                 replicated: bool = False):
        super().__init__()
        if replicated and tp.size != 1:
            raise ValueError("a replicated embedding takes tp=Group.single('tp')")
        local = _divide(num_embeddings, tp.size, "num_embeddings (vocab size)")
        self.num_embeddings, self.embedding_dim, self.tp = num_embeddings, embedding_dim, tp
        self.vocab_start, self.vocab_end = tp.rank * local, (tp.rank + 1) * local
        self.weight = nn.Parameter(torch.empty(local, embedding_dim))
        tag_parameter(self.weight, "normal", tp=tp, std=init_std, full_shape=(num_embeddings, embedding_dim),
                      **({} if replicated else {"shard_dim": 0}))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            out = F.embedding(tokens, self.weight)
        else:
            outside = (tokens < self.vocab_start) | (tokens >= self.vocab_end)
            local_ids = (tokens - self.vocab_start).masked_fill(outside, 0)
            out = F.embedding(local_ids, self.weight).masked_fill(outside.unsqueeze(-1), 0.0)
        return out.transpose(0, 1).contiguous()

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, tp={self.tp.size}"


class PositionEmbedding(nn.Module):
    """Learned absolute positions; forward(tokens [b, s]) -> [s, b, h] for positions 0..s-1, the
    rows offset..offset+s-1 of the table (OPT's learned positions start at row 2).
    With a context-parallel `cp` of size N > 1, tokens are this rank's load-balanced chunks of
    an N*s sequence and the rows are their global positions (load_balanced_positions)."""

    def __init__(self, max_positions: int, embedding_dim: int, *, init_std: float = 0.02,
                 cp: Group | None = None, offset: int = 0):
        super().__init__()
        self.max_positions, self.cp, self.offset = max_positions, cp, offset
        self.weight = nn.Parameter(torch.empty(max_positions, embedding_dim))
        tag_parameter(self.weight, "normal", std=init_std)

    def forward(self, tokens: torch.Tensor, position_ids: torch.Tensor | None = None) -> torch.Tensor:
        """position_ids [b, S] (S the whole sequence, also under context parallelism): each
        token's position (row position + offset), e.g. within its packed document (Megatron's
        --reset-position-ids); default 0..S-1."""
        b, s = tokens.shape
        n = self.cp.size if self.cp is not None else 1
        if s * n + self.offset > self.max_positions:
            rows = f" (rows from {self.offset})" if self.offset else ""
            raise ValueError(f"sequence length {s * n}{rows} exceeds max_positions={self.max_positions}")
        if position_ids is not None:
            if tuple(position_ids.shape) != (b, s * n):
                raise ValueError(f"position_ids must be [b, s] = [{b}, {s * n}] (the whole sequence's, also under "
                                 f"context parallelism), got {tuple(position_ids.shape)}")
            if n > 1:
                position_ids = position_ids.index_select(1, load_balanced_positions(s, self.cp, tokens.device))
            return F.embedding(position_ids + self.offset, self.weight).transpose(0, 1)
        rows = self.weight[self.offset:self.offset + s] if n == 1 else self.weight.index_select(
            0, load_balanced_positions(s, self.cp, self.weight.device) + self.offset)
        # A broadcast view over the batch: the caller adds it to the token embedding.
        return rows.unsqueeze(1).expand(s, b, self.weight.shape[1])


class _AllReduceSum(torch.autograd.Function):
    """Sum over the TP group that every rank then uses: all-reduce forward, and all-reduce the
    gradient backward (each rank's part reaches every rank's result)."""

    @staticmethod
    def forward(ctx, x, tp):
        ctx.tp = tp
        out = x.contiguous().clone()
        comm.all_reduce(out, tp)
        return out

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous().clone()
        comm.all_reduce(grad, ctx.tp)
        return grad, None


class _Norm(nn.Module):
    """Shared by LayerNorm and RMSNorm: the weight ([hidden] or [head_dim] with head_dim, held as
    (weight - 1) with zero_centered_gamma), per-head reshapes, statistics in at least fp32.

    `heads` (with head_dim): one gain (and bias) per head, [heads, head_dim] (Cohere Command R+'s
    q/k norms), sharded over `tp` with the heads: this rank's heads/t, or its one replicated head
    when there are fewer heads than ranks (as the K/V heads of a fused QKV)."""

    def __init__(self, hidden_size: int, eps: float, zero_centered_gamma: bool, head_dim: int | None,
                 bias: bool, heads: int | None = None, tp: Group | None = None, affine: bool = True):
        super().__init__()
        if head_dim is not None and hidden_size % head_dim:
            raise ValueError(f"hidden_size {hidden_size} is not a multiple of head_dim {head_dim}")
        if heads is not None and head_dim is None:
            raise ValueError("a gain per head needs head_dim")
        self.hidden_size, self.eps, self.head_dim, self.heads = hidden_size, eps, head_dim, heads
        self.zero_centered_gamma = zero_centered_gamma
        gain = "zeros" if zero_centered_gamma else "ones"
        if not affine:  # normalized only (Llama 4's q/k norm): no gain, no bias
            self.weight = self.bias = None
            return
        if heads is None:
            size = head_dim or hidden_size
            self.weight = tag_parameter(nn.Parameter(torch.empty(size)), gain)
            self.bias = tag_parameter(nn.Parameter(torch.empty(size)), "zeros") if bias else None
        else:
            tp = tp or Group.single("tp")
            local = (max(1, heads // tp.size), head_dim)
            shard = dict(tp=tp, full_shape=(heads, head_dim), shard_dim=0, units=(heads,))
            self.weight = tag_parameter(nn.Parameter(torch.empty(local)), gain, **shard)
            self.bias = tag_parameter(nn.Parameter(torch.empty(local)), "zeros", **shard) if bias else None
        with torch.no_grad():  # usable before init_parameters, e.g. in tests
            self.weight.fill_(0.0 if zero_centered_gamma else 1.0)
            if self.bias is not None:
                self.bias.zero_()

    def gain(self, dtype, weight=None) -> torch.Tensor | float:
        if self.weight is None:
            return 1.0
        w = (self.weight if weight is None else weight).to(dtype)
        return w + 1.0 if self.zero_centered_gamma else w

    def per_head(self, x: torch.Tensor) -> torch.Tensor:
        if self.head_dim is None:
            return x
        if x.shape[-1] % self.head_dim:
            raise ValueError(f"last dim {x.shape[-1]} is not a multiple of head_dim {self.head_dim}")
        return x.reshape(*x.shape[:-1], x.shape[-1] // self.head_dim, self.head_dim)

    def extra_repr(self) -> str:
        extra = f", head_dim={self.head_dim}" if self.head_dim else ""
        extra += ", zero_centered_gamma=True" if self.zero_centered_gamma else ""
        extra += f", heads={self.heads}" if self.heads else ""
        extra += ", elementwise_affine=False" if self.weight is None else ""
        return f"{self.hidden_size}, eps={self.eps}{extra}"


class LayerNorm(_Norm):
    """LayerNorm over the last dim, or over each head of `head_dim` (one weight for all heads);
    without a bias when bias=False; scaled by (1 + weight) with zero_centered_gamma."""

    def __init__(self, hidden_size: int, eps: float = 1e-5, *, bias: bool = True, zero_centered_gamma: bool = False,
                 head_dim: int | None = None, heads: int | None = None, tp: Group | None = None):
        super().__init__(hidden_size, eps, zero_centered_gamma, head_dim, bias, heads, tp)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = _at_least_fp32(x.dtype)
        h = self.per_head(x.to(dtype))
        bias = self.bias.to(dtype) if self.bias is not None else None
        if self.heads is not None:  # statistics over each head, then its own gain and bias
            y = F.layer_norm(h, (self.head_dim,), None, None, self.eps) * self.gain(dtype)
            y = y if bias is None else y + bias
        else:
            y = F.layer_norm(h, self.weight.shape, self.gain(dtype), bias, self.eps)
        return y.reshape(x.shape).to(x.dtype)


class RMSNorm(_Norm):
    """RMSNorm over the last dim, or over each head of `head_dim`; scaled by (1 + weight) with
    zero_centered_gamma; not scaled at all, with no weight, when elementwise_affine=False (Llama
    4's q/k norm, transformers' Llama4TextL2Norm).

    With `tp`, the input is this rank's shard of the last dim (S(h): q's or k's local heads) and
    the norm is over the full width: the per-token sum of squares is all-reduced over tp. The
    weight stays whole on every rank (its gradient is then partial over TP) and each rank uses the
    slice of its features: of every segment when the shard is cut by `segments` (full sizes)."""

    def __init__(self, hidden_size: int, eps: float = 1e-6, *, zero_centered_gamma: bool = False,
                 head_dim: int | None = None, tp: Group | None = None, segments=None, heads: int | None = None,
                 elementwise_affine: bool = True):
        super().__init__(hidden_size, eps, zero_centered_gamma, head_dim, bias=False, heads=heads,
                         tp=tp if heads is not None else None, affine=elementwise_affine)
        self.tp = tp if tp is not None and tp.size > 1 and head_dim is None else None
        self.features = None  # (start, end) of this rank's features in the full width
        if self.tp is not None:
            segments = [int(n) for n in (segments or [hidden_size])]
            if sum(segments) != hidden_size:
                raise ValueError(f"segments {segments} do not sum to hidden_size {hidden_size}")
            self.features, start = [], 0
            for n in segments:
                local = _divide(n, self.tp.size, "segment size")
                self.features.append((start + self.tp.rank * local, start + (self.tp.rank + 1) * local))
                start += n

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.to(_at_least_fp32(x.dtype))
        if self.tp is None:
            h = self.per_head(xf)
            y = h * torch.rsqrt(h.pow(2).mean(dim=-1, keepdim=True) + self.eps)
            return (y * self.gain(xf.dtype)).reshape(x.shape).to(x.dtype)
        local = sum(b - a for a, b in self.features)
        if x.shape[-1] != local:
            raise ValueError(f"expected this rank's {local} of {self.hidden_size} features, got last dim {x.shape[-1]}")
        squares = _AllReduceSum.apply(xf.pow(2).sum(dim=-1, keepdim=True), self.tp)
        y = xf * torch.rsqrt(squares / self.hidden_size + self.eps)
        if self.weight is None:
            return y.to(x.dtype)
        weight = torch.cat([self.weight[a:b] for a, b in self.features]) if len(self.features) > 1 else \
            self.weight[self.features[0][0]:self.features[0][1]]
        return (y * self.gain(xf.dtype, weight)).to(x.dtype)


def full_shape(local_shape, layout: str, tp: Group) -> tuple:
    """The full shape of a value this rank holds a `layout` piece of."""
    shape = list(local_shape)
    if layout == "S(s)":
        shape[0] *= tp.size
    elif layout == "S(h)":
        shape[-1] *= tp.size
    return tuple(shape)


class Dropout(nn.Module):
    """Dropout on a named RNG stream: "default" in replicated regions (the same mask
    on every TP rank), "tensor-parallel" in sharded regions (a different mask per
    rank). Without a tracker it uses torch's default generator. `layout` and `tp` say
    how the input is sharded over TP, `cp` over context parallelism (sequence dim 0, in
    load-balanced chunks); a tracker in TP-invariant mode then draws the mask of the full
    sequence and keeps this rank's piece (its CP chunks, then its TP slice of them), so any
    TP x CP drops what TP=1 CP=1 drops."""

    _STREAMS = ("default", "tensor-parallel")

    def __init__(self, p: float, *, rng_tracker: RNGTracker | None = None, stream: str = "default",
                 layout: str = "I", tp: Group | None = None, cp: Group | None = None):
        super().__init__()
        if stream not in self._STREAMS:
            raise ValueError(f"dropout stream must be one of {self._STREAMS}, got {stream!r}")
        if not 0.0 <= p < 1.0:
            raise ValueError(f"dropout probability must be in [0, 1), got {p}")
        self.p, self.rng_tracker, self.stream = p, rng_tracker, stream
        self.layout, self.tp, self.cp = layout, tp or Group.single("tp"), cp or Group.single("cp")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training or self.p == 0.0:
            return x
        if self.rng_tracker is None:
            return F.dropout(x, self.p, training=True)
        if self.rng_tracker.tp_invariant:
            shape = list(full_shape(x.shape, self.layout, self.tp))
            cp_local = shape[0]
            shape[0] *= self.cp.size
            full = self.rng_tracker.full_keep_mask(shape, self.p, x.device)
            if self.cp.size > 1:  # this rank's load-balanced chunks of the sequence, then its TP slice
                full = full.index_select(0, load_balanced_positions(cp_local, self.cp, x.device))
            keep = local_piece(full, self.layout, self.tp)
            return x * keep.to(x.dtype) / (1.0 - self.p)
        with self.rng_tracker.fork(self.stream):
            return F.dropout(x, self.p, training=True)

    def extra_repr(self) -> str:
        return f"p={self.p}, stream={self.stream}, layout={self.layout}"
