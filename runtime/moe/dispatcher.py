"""Token dispatch and combine over the expert-parallel group (Megatron Core's
MoEAlltoAllTokenDispatcher, written small).

Dispatch: the (token, expert) pairs this rank routed are sorted by expert, each EP rank is sent
the rows for the experts it holds (experts are split in contiguous blocks: rank r holds experts
r*E/ep ...), after one small all-to-all of the per-expert counts so every rank knows what it will
receive. The received rows come ordered by source rank, then expert; they are regrouped by local
expert for the grouped GEMMs. Combine undoes each step in reverse: the all-to-all back, the
unsort, and the weighted sum over each token's k experts. Both all-to-alls are autograd
functions whose backward is the opposite all-to-all, so a step issues 3 forward (counts,
tokens, combine) and 2 backward all-to-alls per MoE layer when ep > 1, none at ep = 1."""

from __future__ import annotations

import torch

from .. import comm
from ..parallel_state import Group


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, output_splits, input_splits):
        ctx.group, ctx.output_splits, ctx.input_splits = group, output_splits, input_splits
        out = x.new_empty((sum(output_splits), *x.shape[1:]))
        comm.all_to_all(out, x.contiguous(), group, output_splits, input_splits)
        return out

    @staticmethod
    def backward(ctx, grad):
        out = grad.new_empty((sum(ctx.input_splits), *grad.shape[1:]))
        comm.all_to_all(out, grad.contiguous(), ctx.group, ctx.input_splits, ctx.output_splits)
        return out, None, None, None


def all_to_all(x: torch.Tensor, group: Group, output_splits: list, input_splits: list) -> torch.Tensor:
    """Rows of `x` cut by `input_splits` sent to the ranks of `group`; backward sends the
    gradients back the same way. The identity on a group of one."""
    if group.size == 1:
        return x
    return _AllToAll.apply(x, group, list(output_splits), list(input_splits))


class Routing:
    """What dispatch computed and combine needs (one forward's state, as Megatron's dispatcher
    keeps it on itself): the pair order, the split sizes, the regrouping."""

    def __init__(self, **kw):
        self.__dict__.update(kw)


class AllToAllTokenDispatcher:
    def __init__(self, num_experts: int, ep: Group):
        if num_experts % ep.size:
            raise ValueError(f"{num_experts} experts are not divisible by the expert-parallel size {ep.size}")
        self.num_experts, self.ep = num_experts, ep
        self.num_local_experts = num_experts // ep.size

    def dispatch(self, tokens: torch.Tensor, expert_ids: torch.Tensor, kept: torch.Tensor | None):
        """tokens [T, h], expert_ids [T, k] -> (rows [M, h] grouped by local expert, tokens per
        local expert (a list), the Routing for combine)."""
        T, k = expert_ids.shape
        pair_token = torch.arange(T, device=tokens.device).repeat_interleave(k)
        pair_expert = expert_ids.reshape(-1)
        pair_index = torch.arange(T * k, device=tokens.device)
        if kept is not None:
            keep = kept.reshape(-1)
            pair_token, pair_expert, pair_index = pair_token[keep], pair_expert[keep], pair_index[keep]
        order = torch.argsort(pair_expert, stable=True)
        counts = torch.bincount(pair_expert, minlength=self.num_experts)  # [E] sent, per expert
        permuted = tokens.index_select(0, pair_token[order])
        ep, local = self.ep.size, self.num_local_experts
        if ep == 1:
            received_counts = counts.view(1, local)
        else:
            received_counts = torch.empty_like(counts)
            comm.all_to_all(received_counts, counts.contiguous(), self.ep)  # [ep * local]: what each source sends me
            received_counts = received_counts.view(ep, local)
        input_splits = counts.view(ep, local).sum(1).tolist()
        output_splits = received_counts.sum(1).tolist()
        received = all_to_all(permuted, self.ep, output_splits, input_splits)
        regroup = None
        if ep > 1:  # rows arrive by source rank, then expert: group them by local expert
            local_ids = torch.arange(local, device=tokens.device).repeat(ep).repeat_interleave(received_counts.reshape(-1))
            regroup = torch.argsort(local_ids, stable=True)
            received = received.index_select(0, regroup)
        per_expert = received_counts.sum(0).tolist()
        routing = Routing(pair_token=pair_token, pair_index=pair_index, order=order, tokens=T, topk=k,
                          input_splits=input_splits, output_splits=output_splits, regroup=regroup)
        return received, per_expert, routing

    def combine(self, rows: torch.Tensor, weights: torch.Tensor, routing: Routing) -> torch.Tensor:
        """Expert outputs [M, h] (grouped by local expert) -> [T, h]: each token's outputs weighted
        by its routing weights and summed."""
        if routing.regroup is not None:
            rows = rows.index_select(0, torch.argsort(routing.regroup))
        rows = all_to_all(rows, self.ep, routing.input_splits, routing.output_splits)
        rows = rows.index_select(0, torch.argsort(routing.order))  # back to pair order
        w = weights.reshape(-1).index_select(0, routing.pair_index).to(rows.dtype)
        out = rows.new_zeros((routing.tokens, rows.shape[-1]))
        return out.index_add(0, routing.pair_token, rows * w.unsqueeze(-1))
