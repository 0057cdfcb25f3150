"""Mixture of experts: the top-k router, the all-to-all token dispatcher over the expert-parallel
group, grouped experts and the MoE layer generated modules build (docs/moe.md)."""

from .dispatcher import AllToAllTokenDispatcher, all_to_all
from .experts import GroupedMLP
from .layer import MoELayer, SharedExpertMLP, aux_losses, is_expert_param, set_aux_loss_scale, update_expert_biases
from .router import TopKRouter

__all__ = ["AllToAllTokenDispatcher", "GroupedMLP", "MoELayer", "SharedExpertMLP", "TopKRouter", "all_to_all",
           "aux_losses", "is_expert_param", "set_aux_loss_scale", "update_expert_biases"]
