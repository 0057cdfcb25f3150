"""The MoE layer a generated module calls: router, token dispatch, grouped experts, combine, and
optional shared experts that every token passes through (Qwen2-MoE, DeepSeek-MoE), optionally
scaled by a sigmoid gate (Qwen2-MoE's shared_expert_gate). With apply_probs_on_input (Llama 4,
Megatron's --moe-apply-probs-on-input; top-1 only) the routing weight scales the token the expert
receives instead of the expert's output.

Layouts on tp: the input is R (the tokens of the TP group on every TP rank: the compiler
all-gathers them with sequence parallelism), the output P (partial sums over TP, which the
compiler reduces or reduce-scatters after it, as after a dense MLP)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..activations import ACTIVATIONS, GATED
from ..init import tag_parameter
from ..layers import ColumnParallelLinear, RowParallelLinear
from ..parallel_state import Group
from .dispatcher import AllToAllTokenDispatcher
from .experts import GroupedMLP
from .router import TopKRouter


class SharedExpertMLP(nn.Module):
    def __init__(self, hidden_size: int, ffn_hidden_size: int, *, tp: Group, activation: str = "swiglu",
                 gate: bool = False, init_std: float = 0.02):
        super().__init__()
        gated = activation in GATED
        self.activation = activation
        self.linear_fc1 = ColumnParallelLinear(hidden_size, 2 * ffn_hidden_size if gated else ffn_hidden_size, bias=False,
                                               segments=[ffn_hidden_size] * 2 if gated else None, tp=tp, init_std=init_std)
        self.linear_fc2 = RowParallelLinear(ffn_hidden_size, hidden_size, bias=False, tp=tp, init_std=init_std)
        if gate:
            self.gate_weight = nn.Parameter(torch.empty(1, hidden_size))
            tag_parameter(self.gate_weight, "normal", std=init_std)
        else:
            self.gate_weight = None

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        out = self.linear_fc2(ACTIVATIONS[self.activation](self.linear_fc1(tokens)))
        if self.gate_weight is not None:  # scales a TP-partial sum: still a partial sum
            out = torch.sigmoid(F.linear(tokens, self.gate_weight)) * out
        return out


class MoELayer(nn.Module):
    def __init__(self, hidden_size: int, num_experts: int, ffn_hidden_size: int, *, topk: int, tp: Group,
                 ep: Group | None = None, cp: Group | None = None, activation: str = "swiglu",
                 score_function: str = "softmax", topk_renorm: bool = False, load_balancing_type: str = "aux_loss",
                 aux_loss_coeff: float = 0.0, z_loss_coeff: float = 0.0, expert_bias: bool = False,
                 expert_bias_update_rate: float = 1e-3, capacity_factor: float | None = None,
                 shared_expert_size: int = 0, shared_expert_gate: bool = False, grouped: bool = True,
                 init_std: float = 0.02, num_groups: int = 1, group_topk: int = 1, topk_scaling_factor: float = 1.0,
                 apply_probs_on_input: bool = False):
        super().__init__()
        if apply_probs_on_input and topk != 1:
            raise ValueError(f"apply_probs_on_input needs topk 1 (a token's one expert), got topk={topk}")
        ep = ep or Group.single("ep")
        self.apply_probs_on_input = apply_probs_on_input
        self.hidden_size = hidden_size
        self.router = TopKRouter(hidden_size, num_experts, topk, tp=tp, cp=cp, score_function=score_function,
                                 topk_renorm=topk_renorm, load_balancing_type=load_balancing_type,
                                 aux_loss_coeff=aux_loss_coeff, z_loss_coeff=z_loss_coeff, expert_bias=expert_bias,
                                 expert_bias_update_rate=expert_bias_update_rate, capacity_factor=capacity_factor,
                                 init_std=init_std, num_groups=num_groups, group_topk=group_topk,
                                 topk_scaling_factor=topk_scaling_factor)
        self.experts = GroupedMLP(num_experts, hidden_size, ffn_hidden_size, tp=tp, ep=ep, activation=activation,
                                  init_std=init_std, grouped=grouped)
        self.shared_experts = (SharedExpertMLP(hidden_size, shared_expert_size, tp=tp, activation=activation,
                                               gate=shared_expert_gate, init_std=init_std)
                               if shared_expert_size else None)
        self.dispatcher = AllToAllTokenDispatcher(num_experts, ep)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [s, b, h] (R on tp) -> [s, b, h] partial sums over TP."""
        tokens = x.reshape(-1, self.hidden_size)
        weights, expert_ids, kept = self.router(tokens)
        routed = tokens
        if self.apply_probs_on_input:  # Llama 4: the expert gets its token scaled, its output is not
            routed, weights = tokens * weights.to(tokens.dtype), torch.ones_like(weights)
        rows, per_expert, routing = self.dispatcher.dispatch(routed, expert_ids, kept)
        out = self.dispatcher.combine(self.experts(rows, per_expert), weights, routing)
        if self.shared_experts is not None:
            out = out + self.shared_experts(tokens)
        return out.view_as(x)


def aux_losses(model: nn.Module) -> dict:
    """{name: this rank's part of the loss, summed over the MoE layers} of the last forward (the
    load-balancing loss and the z-loss, already scaled by their coefficients). With context
    parallelism each CP rank holds the part of its tokens: sum over CP for the sequence's."""
    out: dict = {}
    for module in model.modules():
        if isinstance(module, TopKRouter):
            for name, value in module.last_losses.items():
                out[name] = out.get(name, 0.0) + value
    return out


def set_aux_loss_scale(model: nn.Module, scale: float) -> None:
    """Scale the auxiliary losses' gradient as the LM loss's is scaled: with gradients accumulated
    over M micro-batches, each backward of loss / M must give the auxiliary losses 1 / M too
    (Megatron's MoEAuxLossAutoScaler.set_loss_scale)."""
    for module in model.modules():
        if isinstance(module, TopKRouter):
            module.aux_loss_scale = float(scale)


def update_expert_biases(model: nn.Module, dp: Group) -> None:
    """After the optimizer step: move every bias-balanced router's expert bias (DeepSeek-V3)."""
    for module in model.modules():
        if isinstance(module, TopKRouter):
            module.update_expert_bias(dp)


def is_expert_param(p: torch.nn.Parameter) -> bool:
    """Expert weights are data-parallel over the expert-data-parallel group, not the dense one."""
    return getattr(p, "_specc_expert_parallel", False)
