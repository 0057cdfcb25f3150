"""The Mamba-2 mixer between its in- and out-projections (Megatron Core's MambaMixer, Dao & Gu
2024): a depthwise causal conv1d with SiLU on [x | B | C], the chunked state-space-duality (SSD)
scan per head, the skip D, and the RMS norm per group gated by SiLU(z).

Sequence-first like every activation: forward([s, b, 2*I + 2*G*N + H]) -> [s, b, I], the input
being the in-projection's output [z | x | B | C | dt] (I = heads * head_dim, G groups of state
size N, H heads). Under tensor parallelism it takes this rank's shard of each segment (the
compiler's column-parallel in-projection cuts it segment by segment) and returns its heads' slice
of y (S(h)) for the row-parallel out-projection: a rank holds heads [r*H/t, (r+1)*H/t) and groups
[r*G/t, (r+1)*G/t), so every head's group and every norm group lie on its own rank, and nothing
is communicated. Pure torch (CPU and GPU alike): the scan's forward runs again in backward
(runtime.recompute), so only the input is kept, as the fused kernels keep little more."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .activation_recompute import recompute
from .init import tag_parameter
from .parallel_state import Group


def _segment_sum(x: torch.Tensor) -> torch.Tensor:
    """[..., T] -> [..., T, T]: out[i, j] = x[j+1] + ... + x[i] for i >= j, -inf above the diagonal
    (the log of the decay from position j to i), by masked cumulative sums for stability."""
    t = x.shape[-1]
    grid = x[..., None].expand(*x.shape, t)  # grid[..., i, j] = x[i]
    below = torch.tril(torch.ones(t, t, dtype=torch.bool, device=x.device), diagonal=-1)
    sums = torch.cumsum(grid.masked_fill(~below, 0), dim=-2)
    keep = torch.tril(torch.ones(t, t, dtype=torch.bool, device=x.device))
    return sums.masked_fill(~keep, float("-inf"))


def ssd_scan(x, dt, A, B, C, chunk_size: int) -> torch.Tensor:
    """y[t] = C[t] . h[t] with h[t] = exp(dt[t] A) h[t-1] + dt[t] B[t] x[t], computed in chunks of
    `chunk_size`: within a chunk as a masked (attention-like) product, across chunks by passing
    each chunk's final state on (Mamba-2's SSD). x [b, s, h, p], dt [b, s, h] (already softplus'd),
    A [h], B and C [b, s, h, n] (one per head); float32 in, float32 out, [b, s, h, p]."""
    b, s, h, p = x.shape
    pad = (chunk_size - s % chunk_size) % chunk_size

    def chunks(t):  # [b, s, ...] -> [b, chunks, chunk_size, ...], zero-padded at the end
        t = F.pad(t, (0, 0) * (t.dim() - 2) + (0, pad))
        return t.reshape(b, -1, chunk_size, *t.shape[2:])

    x, B, C = chunks(x * dt[..., None]), chunks(B), chunks(C)
    a = chunks(A * dt).permute(0, 3, 1, 2)  # [b, h, chunks, l]
    a_cum = torch.cumsum(a, dim=-1)
    # within each chunk: y_l = sum_{s <= l} (C_l . B_s) exp(a_{s+1} + ... + a_l) x_s
    decay = torch.exp(_segment_sum(a))  # [b, h, c, l, s]
    scores = torch.einsum("bclhn,bcshn->bhcls", C, B) * decay
    y = torch.einsum("bhcls,bcshp->bclhp", scores, x)
    # each chunk's final state, then the state entering each chunk (a recurrence over chunks)
    to_end = torch.exp(a_cum[..., -1:] - a_cum)  # [b, h, c, l]
    states = torch.einsum("bclhn,bhcl,bclhp->bchpn", B, to_end, x)
    states = torch.cat([torch.zeros_like(states[:, :1]), states], dim=1)
    across = torch.exp(_segment_sum(F.pad(a_cum[..., -1], (1, 0))))  # [b, h, c+1, c+1]
    entering = torch.einsum("bhzc,bchpn->bzhpn", across, states)[:, :-1]
    # what the entering state contributes at each position of its chunk
    y = y + torch.einsum("bclhn,bchpn,bhcl->bclhp", C, entering, torch.exp(a_cum))
    return y.reshape(b, -1, h, p)[:, :s]


class _Weights(nn.Module):
    """A holder of named parameters (conv1d.weight, norm.weight), as Megatron's submodules name them."""


class Mamba2Mixer(nn.Module):
    """Conv1d, the SSD scan and the gated norm of a Mamba-2 mixer on one TP rank (module docstring).
    `dt_min`: dt is clamped from below after softplus (transformers' time_step_min clamp)."""

    def __init__(self, num_heads: int, head_dim: int, state_size: int, *, tp: Group, num_groups: int = 1,
                 conv_kernel: int = 4, conv_bias: bool = True, chunk_size: int = 128, norm_eps: float = 1e-5,
                 dt_min: float = 0.0):
        super().__init__()
        t = tp.size
        for what, n in (("num_heads", num_heads), ("num_groups", num_groups)):
            if n % t:
                raise ValueError(f"{what}={n} is not divisible by the tensor-parallel size {t}")
        if num_heads % num_groups:
            raise ValueError(f"num_heads={num_heads} is not a multiple of num_groups={num_groups}")
        self.heads, self.groups, self.head_dim, self.state_size = num_heads // t, num_groups // t, head_dim, state_size
        self.chunk_size, self.norm_eps, self.dt_min, self.tp = chunk_size, norm_eps, dt_min, tp
        inner, gn = num_heads * head_dim, num_groups * state_size
        self.inner = self.heads * head_dim  # this rank's features of z, x and y
        channels = (inner, gn, gn)  # the conv's [x | B | C], each sharded on its own
        local = sum(channels) // t
        self.conv1d = _Weights()
        self.conv1d.weight = nn.Parameter(torch.empty(local, 1, conv_kernel))
        # PyTorch's Conv1d default (kaiming uniform, fan-in = kernel) has this std
        tag_parameter(self.conv1d.weight, "normal", tp=tp, std=(3 * conv_kernel) ** -0.5,
                      full_shape=(sum(channels), 1, conv_kernel), shard_dim=0, segments=channels)
        if conv_bias:
            self.conv1d.bias = nn.Parameter(torch.empty(local))
            tag_parameter(self.conv1d.bias, "zeros", tp=tp, full_shape=(sum(channels),), shard_dim=0,
                          segments=channels)
        else:
            self.conv1d.bias = None
        per_head = {"A_log": "ssm_a_log", "D": "ones", "dt_bias": "ssm_dt_bias"}  # Megatron's draws (runtime.init)
        for name, kind in per_head.items():
            setattr(self, name, tag_parameter(nn.Parameter(torch.empty(self.heads)), kind, tp=tp,
                                              full_shape=(num_heads,), shard_dim=0))
        self.norm = _Weights()
        self.norm.weight = tag_parameter(nn.Parameter(torch.empty(self.inner)), "ones", tp=tp, full_shape=(inner,),
                                         shard_dim=0)

    def forward(self, zxbcdt: torch.Tensor) -> torch.Tensor:
        gn = self.groups * self.state_size
        width = 2 * self.inner + 2 * gn + self.heads
        if zxbcdt.shape[-1] != width:
            raise ValueError(f"expected this rank's [z | x | B | C | dt] of {width} features, got {zxbcdt.shape[-1]}")
        return recompute(self._mix, zxbcdt)

    def _mix(self, zxbcdt: torch.Tensor) -> torch.Tensor:
        s, b, _ = zxbcdt.shape
        h, p, n, g = self.heads, self.head_dim, self.state_size, self.groups
        z, xbc, dt = zxbcdt.split([self.inner, self.inner + 2 * g * n, h], dim=-1)
        # depthwise causal conv over the sequence: pad K-1 in front, keep the first s outputs
        k = self.conv1d.weight.shape[-1]
        conv = F.conv1d(xbc.permute(1, 2, 0), self.conv1d.weight, self.conv1d.bias, padding=k - 1,
                        groups=xbc.shape[-1])[..., :s]
        xbc = F.silu(conv).permute(0, 2, 1)  # [b, s, channels]
        x, B, C = xbc.split([self.inner, g * n, g * n], dim=-1)
        per_group = h // g  # head i reads group i // per_group (both local: whole groups per rank)
        B = B.reshape(b, s, g, n).float().repeat_interleave(per_group, dim=2)
        C = C.reshape(b, s, g, n).float().repeat_interleave(per_group, dim=2)
        dt = F.softplus(dt.transpose(0, 1) + self.dt_bias.to(dt.dtype)).clamp(min=self.dt_min).float()
        x = x.reshape(b, s, h, p).float()
        y = ssd_scan(x, dt, -torch.exp(self.A_log.float()), B, C, self.chunk_size)
        y = y + self.D.float()[:, None] * x
        # RMS norm per group of y * silu(z); the groups are the rank's own (I/G features each)
        gated = y.reshape(b, s, -1) * F.silu(z.transpose(0, 1).float())
        grouped = gated.reshape(b, s, g, -1)
        normed = grouped * torch.rsqrt(grouped.pow(2).mean(-1, keepdim=True) + self.norm_eps)
        out = normed.reshape(b, s, -1) * self.norm.weight.float()
        return out.transpose(0, 1).to(zxbcdt.dtype)

    def extra_repr(self) -> str:
        return (f"heads={self.heads}, head_dim={self.head_dim}, groups={self.groups}, state={self.state_size}, "
                f"chunk={self.chunk_size}, tp={self.tp.size}")
