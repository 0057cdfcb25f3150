"""Cross-entropy over vocab-sharded logits, without gathering the logits.

Forward issues two all-reduces on the TP group: MAX of the per-token max, then one
SUM of the stacked [predicted logit, sum of exp] (fused into one buffer to halve
the latency-bound collectives). Backward needs no communication: the gradient on
the local shard is softmax minus one-hot, both local.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from . import comm
from .parallel_state import Group


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, labels, tp):
        local_vocab = logits.shape[-1]
        start = tp.rank * local_vocab
        target = labels.t()  # [b, s] -> [s, b], to match sequence-first logits

        shifted = logits.to(torch.promote_types(logits.dtype, torch.float32))  # fp32 (fp64 stays)
        row_max = shifted.max(dim=-1).values.contiguous()
        comm.all_reduce(row_max, tp, op="max")
        shifted = shifted - row_max.unsqueeze(-1)

        outside = (target < start) | (target >= start + local_vocab)
        local_target = (target - start).masked_fill(outside, 0)
        predicted = shifted.gather(-1, local_target.unsqueeze(-1)).squeeze(-1).masked_fill(outside, 0.0)
        exp = shifted.exp_()
        sums = torch.stack([predicted, exp.sum(dim=-1)])  # [2, s, b]
        comm.all_reduce(sums, tp)
        predicted, sum_exp = sums[0], sums[1]

        loss = torch.log(sum_exp) - predicted  # [s, b]
        softmax = exp.div_(sum_exp.unsqueeze(-1))
        ctx.save_for_backward(softmax, local_target, outside)
        ctx.logits_dtype = logits.dtype
        return loss.t().contiguous()  # [b, s]

    @staticmethod
    def backward(ctx, grad_loss):
        softmax, local_target, outside = ctx.saved_tensors
        grad = softmax.clone()
        # Subtract the one-hot target where it lies in this rank's vocab slice.
        hit = (~outside).to(grad.dtype).unsqueeze(-1)
        grad.scatter_add_(-1, local_target.unsqueeze(-1), -hit)
        grad.mul_(grad_loss.t().unsqueeze(-1))
        return grad.to(ctx.logits_dtype), None, None


def vocab_parallel_cross_entropy(logits: torch.Tensor, labels: torch.Tensor, tp: Group) -> torch.Tensor:
    """logits [s, b, V/t] (rank r holds vocab ids r*V/t ..), labels [b, s] long
    -> per-token loss [b, s] in fp32 (fp64 for fp64 logits). Equals F.cross_entropy on the gathered logits."""
    if logits.dim() != 3 or labels.dim() != 2 or tuple(labels.shape) != (logits.shape[1], logits.shape[0]):
        raise ValueError(
            f"expected logits [s, b, V/t] and labels [b, s]; got logits {tuple(logits.shape)} "
            f"and labels {tuple(labels.shape)}"
        )
    if tp.size == 1:  # the whole vocabulary is here: torch's fused kernel, no collectives
        s, b, v = logits.shape
        flat = logits.to(torch.promote_types(logits.dtype, torch.float32)).reshape(s * b, v)
        return F.cross_entropy(flat, labels.t().reshape(s * b), reduction="none").view(s, b).t().contiguous()
    return _VocabParallelCrossEntropy.apply(logits, labels, tp)
