"""The routed experts: every local expert an MLP (gated or not), run as one grouped computation.

Weights are stacked over the experts, as Hugging Face stores them: linear_fc1 [E, F1, h] (F1 =
2F for a gated unit, laid out [gate | up] per expert) and linear_fc2 [E, h, F]; a rank holds its
block of E/ep experts, each sharded over TP like a dense MLP (fc1 per segment on its output dim,
fc2 on its input dim: the output is a partial sum over TP).

`grouped=True` (the default): the rows of all local experts are laid into one zero-padded
[E_local, max rows, h] batch and each projection is one torch.bmm (zero rows stay zero through a
bias-free MLP and the activations used here). `grouped=False`: a Python loop over the experts,
kept for the benchmark."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..activations import ACTIVATIONS, GATED
from ..init import tag_parameter
from ..parallel_state import Group


class GroupedMLP(nn.Module):
    def __init__(self, num_experts: int, hidden_size: int, ffn_hidden_size: int, *, tp: Group, ep: Group,
                 activation: str = "swiglu", init_std: float = 0.02, grouped: bool = True):
        super().__init__()
        if activation not in ACTIVATIONS:
            raise ValueError(f"expert activation must be one of {sorted(ACTIVATIONS)}, got {activation!r}")
        if ffn_hidden_size % tp.size:
            raise ValueError(f"expert ffn_hidden_size {ffn_hidden_size} is not divisible by the tensor-parallel size {tp.size}")
        if num_experts % ep.size:
            raise ValueError(f"{num_experts} experts are not divisible by the expert-parallel size {ep.size}")
        self.activation, self.grouped = activation, grouped
        gated = activation in GATED
        local_e, local_f = num_experts // ep.size, ffn_hidden_size // tp.size
        fc1_out = 2 * ffn_hidden_size if gated else ffn_hidden_size
        self.linear_fc1 = nn.Module()
        self.linear_fc1.weight = nn.Parameter(torch.empty(local_e, fc1_out // tp.size, hidden_size))
        tag_parameter(self.linear_fc1.weight, "normal", tp=tp, std=init_std, full_shape=(num_experts, fc1_out, hidden_size),
                      shard_dim=1, segments=(ffn_hidden_size,) * (2 if gated else 1), ep=ep, expert_dim=0)
        self.linear_fc2 = nn.Module()
        self.linear_fc2.weight = nn.Parameter(torch.empty(local_e, hidden_size, local_f))
        tag_parameter(self.linear_fc2.weight, "normal", tp=tp, std=init_std,
                      full_shape=(num_experts, hidden_size, ffn_hidden_size), shard_dim=2, ep=ep, expert_dim=0)
        for p in (self.linear_fc1.weight, self.linear_fc2.weight):
            p._specc_expert_parallel = True  # reduced over the expert-data-parallel group

    def forward(self, rows: torch.Tensor, tokens_per_expert: list) -> torch.Tensor:
        """rows [M, h] grouped by local expert, tokens_per_expert [E_local] -> [M, h] (TP-partial)."""
        act = ACTIVATIONS[self.activation]
        w1, w2 = self.linear_fc1.weight, self.linear_fc2.weight
        if not self.grouped:
            outs = [F.linear(act(F.linear(chunk, w1[e])), w2[e])
                    for e, chunk in enumerate(rows.split(tokens_per_expert, dim=0))]
            return torch.cat(outs, dim=0) if outs else rows.new_zeros((0, w2.shape[1]))
        counts = torch.tensor(tokens_per_expert, dtype=torch.long, device=rows.device)
        longest = max(tokens_per_expert) if tokens_per_expert else 0
        expert = torch.repeat_interleave(torch.arange(len(tokens_per_expert), device=rows.device), counts)
        starts = torch.cumsum(counts, 0) - counts
        position = torch.arange(rows.shape[0], device=rows.device) - starts[expert]
        padded = rows.new_zeros((len(tokens_per_expert), longest, rows.shape[-1])).index_put((expert, position), rows)
        hidden = act(torch.bmm(padded, w1.transpose(1, 2)))
        out = torch.bmm(hidden, w2.transpose(1, 2))
        return out[expert, position]

    def extra_repr(self) -> str:
        e, f1, h = self.linear_fc1.weight.shape
        return f"local_experts={e}, hidden={h}, fc1_local={f1}, activation={self.activation}, grouped={self.grouped}"
