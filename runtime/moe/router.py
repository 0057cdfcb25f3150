"""The top-k router (Megatron Core's TopKRouter): scores, top-k selection, the load-balancing
auxiliary loss and the router z-loss, DeepSeek-V3's bias-based balancing, and token dropping at
a capacity factor (dropless by default).

The router sees the tokens of its tensor-parallel group replicated (layout R: every TP rank holds
the same tokens, and a gradient flowing back is summed over TP), so its weight's gradient is
TP-partial and the auxiliary losses add 1/tp of their gradient on each TP rank. With context
parallelism the tokens of one sequence are spread over the CP ranks: the per-expert token counts
of the load-balancing loss are summed over CP, so the loss is the one of the whole sequence."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from .. import comm
from ..activation_recompute import recomputing
from ..init import tag_parameter
from ..parallel_state import Group

SCORE_FUNCTIONS = ("softmax", "sigmoid")
LOAD_BALANCING_TYPES = ("aux_loss", "none")


class _AttachAuxLoss(torch.autograd.Function):
    """Forward: identity on `x`. Backward: the auxiliary loss gets gradient `scale` (Megatron's
    MoEAuxLossAutoScaler), so it trains the router without being added to the LM loss."""

    @staticmethod
    def forward(ctx, x, aux, scale):
        ctx.save_for_backward(aux)
        ctx.scale = scale
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        (aux,) = ctx.saved_tensors
        return grad, torch.full_like(aux, ctx.scale), None


class TopKRouter(nn.Module):
    def __init__(self, hidden_size: int, num_experts: int, topk: int, *, tp: Group, cp: Group | None = None,
                 score_function: str = "softmax", topk_renorm: bool = False, load_balancing_type: str = "aux_loss",
                 aux_loss_coeff: float = 0.0, z_loss_coeff: float = 0.0, expert_bias: bool = False,
                 expert_bias_update_rate: float = 1e-3, capacity_factor: float | None = None,
                 init_std: float = 0.02, num_groups: int = 1, group_topk: int = 1, topk_scaling_factor: float = 1.0):
        super().__init__()
        if score_function not in SCORE_FUNCTIONS:
            raise ValueError(f"score_function must be one of {SCORE_FUNCTIONS}, got {score_function!r}")
        if load_balancing_type not in LOAD_BALANCING_TYPES:
            raise ValueError(f"load_balancing_type must be one of {LOAD_BALANCING_TYPES}, got {load_balancing_type!r}")
        if not 1 <= topk <= num_experts:
            raise ValueError(f"topk={topk} must be between 1 and num_experts={num_experts}")
        if num_groups > 1 and (num_experts % num_groups or not 1 <= group_topk <= num_groups or topk % group_topk
                               or topk // group_topk > num_experts // num_groups):
            raise ValueError(f"group-limited routing needs num_experts={num_experts} divisible by num_groups="
                             f"{num_groups}, 1 <= group_topk={group_topk} <= num_groups, and topk={topk} a multiple "
                             "of group_topk of at most a group's experts each")
        self.num_groups, self.group_topk, self.topk_scaling_factor = num_groups, group_topk, float(topk_scaling_factor)
        self.num_experts, self.topk, self.tp, self.cp = num_experts, topk, tp, cp or Group.single("cp")
        self.score_function, self.topk_renorm = score_function, topk_renorm
        self.load_balancing_type, self.aux_loss_coeff, self.z_loss_coeff = load_balancing_type, aux_loss_coeff, z_loss_coeff
        self.capacity_factor, self.expert_bias_update_rate = capacity_factor, expert_bias_update_rate
        self.weight = nn.Parameter(torch.empty(num_experts, hidden_size))
        tag_parameter(self.weight, "normal", std=init_std)
        if expert_bias:
            # not trained by backward (updated from the token counts after each step), but part of
            # the model's state: a parameter without gradient, so checkpoints save it and Hugging
            # Face import fills it (DeepSeek-V3's e_score_correction_bias)
            self.expert_bias = nn.Parameter(torch.zeros(num_experts), requires_grad=False)
            tag_parameter(self.expert_bias, "zeros")
            self.register_buffer("tokens_per_expert", torch.zeros(num_experts))
        else:
            self.expert_bias = None
        self.last_losses: dict = {}  # this rank's part of the auxiliary losses of the last forward
        # the gradient the auxiliary losses get, as the LM loss's is scaled (1/micro-batches when
        # gradients are accumulated): set by runtime.moe.set_aux_loss_scale
        self.aux_loss_scale = 1.0

    def uses_aux_loss(self) -> bool:
        return self.load_balancing_type == "aux_loss" and self.aux_loss_coeff > 0

    def forward(self, tokens: torch.Tensor):
        """tokens [T, h] -> (weights [T, k], expert ids [T, k], kept [T, k] bool or None)."""
        logits = F.linear(tokens, self.weight).float()
        scores = torch.softmax(logits, dim=-1) if self.score_function == "softmax" else torch.sigmoid(logits)
        select = scores if self.expert_bias is None else scores + self.expert_bias.float()
        expert_ids = self._select(select)
        weights = scores.gather(1, expert_ids)
        if self.topk_renorm:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        if self.topk_scaling_factor != 1.0:
            weights = weights * self.topk_scaling_factor
        kept = self._capacity_mask(scores, expert_ids) if self.capacity_factor else None
        routed = torch.zeros_like(scores).scatter(1, expert_ids, 1.0)  # [T, E] routing map
        if kept is not None:
            routed = torch.zeros_like(scores).scatter(1, expert_ids, kept.to(scores.dtype))
        if self.expert_bias is not None and self.training and not recomputing():  # count each forward once
            with torch.no_grad():
                self.tokens_per_expert += routed.sum(0)
        self.last_losses = {}
        tokens_total = tokens.shape[0] * self.cp.size
        aux = None
        if self.uses_aux_loss():
            counts = routed.sum(0).detach()
            comm.all_reduce(counts, self.cp)  # the counts of the whole sequence
            probs = scores if self.score_function == "softmax" else scores / (scores.sum(-1, keepdim=True) + 1e-20)
            lb = torch.sum(probs.sum(0) * counts) * (self.num_experts * self.aux_loss_coeff
                                                      / (tokens_total * tokens_total * self.topk))
            self.last_losses["load_balancing_loss"] = lb.detach()
            aux = lb
        if self.z_loss_coeff > 0:
            z = torch.logsumexp(logits, dim=-1).square().sum() * (self.z_loss_coeff / tokens_total)
            self.last_losses["z_loss"] = z.detach()
            aux = z if aux is None else aux + z
        if aux is not None and torch.is_grad_enabled():
            # each TP rank holds the same tokens and the router's gradient is summed over TP
            weights = _AttachAuxLoss.apply(weights, aux, self.aux_loss_scale / self.tp.size)
        return weights, expert_ids, kept

    def _select(self, select: torch.Tensor) -> torch.Tensor:
        """The top-k experts of each token by `select` [T, E]; group-limited (DeepSeek-V3,
        Megatron's --moe-router-num-groups): only among the group_topk groups of experts whose
        topk / group_topk best scores sum highest."""
        if self.num_groups > 1:
            grouped = select.view(select.shape[0], self.num_groups, -1)
            group_scores = grouped.topk(self.topk // self.group_topk, dim=-1)[0].sum(dim=-1)
            groups = torch.topk(group_scores, self.group_topk, dim=-1, sorted=False)[1]
            keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter(1, groups, True)
            select = select.masked_fill(~keep.repeat_interleave(grouped.shape[-1], dim=1), float("-inf"))
        return torch.topk(select, self.topk, dim=-1)[1]

    def _capacity_mask(self, scores, expert_ids):
        """Keep at most ceil(T k / E * capacity_factor) tokens per expert, those with the highest
        scores (Megatron's drop policy "probs"); the dropped (token, expert) pairs send nothing."""
        tokens = scores.shape[0]
        capacity = min(tokens, math.ceil(tokens * self.topk / self.num_experts * self.capacity_factor))
        routed = torch.zeros_like(scores, dtype=torch.bool).scatter(1, expert_ids, True)
        ranked = scores.detach().masked_fill(~routed, -1.0)
        top = torch.topk(ranked, capacity, dim=0).indices  # [capacity, E]
        keep = torch.zeros_like(routed).scatter(0, top, True) & routed
        return keep.gather(1, expert_ids)

    @torch.no_grad()
    def update_expert_bias(self, dp: Group) -> None:
        """DeepSeek-V3's auxiliary-loss-free balancing: after a step, raise the bias of the
        experts that got fewer tokens than the mean and lower the others'. The counts are summed
        over the ranks that saw different tokens (CP, DP) first, so every rank moves alike."""
        if self.expert_bias is None:
            return
        counts = self.tokens_per_expert.clone()
        comm.all_reduce(counts, self.cp)
        comm.all_reduce(counts, dp)
        self.expert_bias += self.expert_bias_update_rate * torch.sign(counts.mean() - counts)
        self.tokens_per_expert.zero_()

    def extra_repr(self) -> str:
        return (f"experts={self.num_experts}, topk={self.topk}, score={self.score_function}, "
                f"renorm={self.topk_renorm}, balancing={self.load_balancing_type}"
                + (f", groups={self.num_groups}, group_topk={self.group_topk}" if self.num_groups > 1 else "")
                + (f", scaling={self.topk_scaling_factor}" if self.topk_scaling_factor != 1.0 else ""))
