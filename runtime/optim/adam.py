"""AdamW and SGD over a DistributedDataParallel's flat buffers, replicated or distributed.

Replicated: every data-parallel rank holds Adam state (and, for low-precision parameters, fp32
master weights) for every element, and steps all of it on the all-reduced gradient.

Distributed (`distributed=True`, Megatron's --use-distributed-optimizer, ZeRO-1): each rank
holds state and master weights for its 1/DP shard of every bucket only; the DDP reduce-scatters
the gradients, each rank steps its shard, and the updated parameters are all-gathered back into
every rank's parameter buffer. The update is elementwise, so both follow the same math step for
step; only the memory differs (state per rank / DP).

Master weights: when the parameters are fp32 the parameter buffer itself is the master copy
(updated in place); when they are bf16/fp16 the optimizer keeps fp32 master weights for the
elements it owns and copies them into the parameters after each step.

Gradient clipping uses the global L2 norm over TP and DP, each parameter counted once: a
TP-sharded parameter's shards are summed over the TP group; a replicated parameter (identical on
every TP rank after finalize_model_grads) is counted on TP rank 0 only, and so is a head replicated
over TP ranks (grouped-query K/V with fewer heads than ranks) on its first replica; with the distributed
optimizer the DP shards are summed over the DP group.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch.optim.adam import adam as adam_update

from .. import comm
from ..ddp import DistributedDataParallel
from ..init import is_tied_copy
from ..moe import is_expert_param
from ..parallel_state import ProcessGroups


@dataclass
class _Segment:
    offset: int  # within the owned range
    length: int
    decay: bool  # weight decay applies (matrices; not biases or norm weights)
    in_norm: bool  # counted in the global grad norm on this rank
    expert: bool = False  # an expert weight: other expert-parallel ranks hold other experts
    decoupled: bool = False  # follows the decoupled lr (Megatron's --decoupled-lr: embedding, output layer)


def _norm_pieces(p, meta, start: int, stop: int) -> list:
    """Elements [start, stop) of p's flattening cut where this rank holds rows of a replicated
    head other than its first replica: [(start, stop, counted in the norm)], so each head
    counts once over TP."""
    dup = meta.duplicate_rows() if meta is not None and meta.replicated_units() else []
    if not dup:
        return [(start, stop, True)]
    row = math.prod(p.shape[1:])
    cuts, out, at = sorted((r * row, (r + n) * row) for r, n in dup), [], start
    for x, y in cuts:
        x, y = max(x, start), min(y, stop)
        if x >= y:
            continue
        if at < x:
            out.append((at, x, True))
        out.append((x, y, False))
        at = y
    if at < stop:
        out.append((at, stop, True))
    return out


class _Range:
    def __init__(self, ddp: DistributedDataParallel, lo: int, hi: int, segments: list, separate_master: bool,
                 state: tuple):
        self.lo, self.hi, self.segments = lo, hi, segments
        self.param = ddp.param_buffer[lo:hi]
        self.grad = ddp.grad_buffer[lo:hi]
        self.master = self.param.detach().float().clone() if separate_master else self.param
        for name in state:  # the optimizer's fp32 state over this range (Adam: exp_avg, exp_avg_sq)
            setattr(self, name, torch.zeros(hi - lo, dtype=torch.float32, device=self.param.device))


class FlatOptimizer:
    """What Adam and SGD share: the owned ranges of the flat buffers (with fp32 masters for
    low-precision parameters), fp16's loss scaling (grad_scaler: the gradients are unscaled, and
    an inf/nan found on any rank skips the step on every rank), clipping by the global norm, and
    the distributed optimizer's parameter all-gather, optionally overlapped with the next forward
    (overlap_param_gather: DistributedDataParallel waits for each bucket's gather in a forward
    pre-hook of the modules that use it). Subclasses name their STATE tensors and write _update."""

    STATE: tuple = ()

    def __init__(self, ddp: DistributedDataParallel, pg: ProcessGroups, *, distributed: bool = False,
                 weight_decay: float = 0.01, clip_grad: float = 0.0, grad_scaler=None,
                 overlap_param_gather: bool = False, decoupled=()):
        expected = "reduce_scatter" if distributed else "all_reduce"
        if ddp.grad_reduce != expected:
            raise ValueError(f"a {'distributed' if distributed else 'replicated'} optimizer needs "
                             f"DistributedDataParallel(grad_reduce={expected!r}), got {ddp.grad_reduce!r}")
        if overlap_param_gather and not distributed:
            raise ValueError("overlap_param_gather needs the distributed optimizer (it overlaps its all-gather)")
        self.ddp, self.pg, self.distributed = ddp, pg, distributed
        self.weight_decay, self.clip_grad = weight_decay, clip_grad
        self.grad_scaler = grad_scaler
        self.overlap_param_gather = overlap_param_gather
        self.step_count = 0
        self._decoupled = {id(p) for p in decoupled}  # parameters stepped with step()'s decoupled_lr
        self.separate_master = ddp.param_dtype != torch.float32
        self.ranges = [_Range(ddp, lo, hi, self._segments(lo, hi), self.separate_master, self.STATE)
                       for lo, hi in ddp.grad_shard_ranges()]

    def _segments(self, lo: int, hi: int) -> list:
        out = []
        tp_rank0 = self.pg.tp.rank == 0
        for p in self.ddp.params:
            p_lo, p_hi = self.ddp.param_range[p]
            a, b = max(lo, p_lo), min(hi, p_hi)
            if a >= b:
                continue
            meta = getattr(p, "_specc_init", None)
            sharded = meta is not None and meta.shard_dim is not None and meta.tp_size > 1
            # a weight tied across pipeline stages counts once: on the first stage, not its copy
            in_norm = (sharded or tp_rank0) and not is_tied_copy(p)
            for x, y, counted in _norm_pieces(p, meta, a - p_lo, b - p_lo):
                out.append(_Segment(offset=p_lo + x - lo, length=y - x, decay=p.dim() > 1,
                                    in_norm=in_norm and counted, expert=is_expert_param(p),
                                    decoupled=id(p) in self._decoupled))
        return out

    # -- memory ----------------------------------------------------------------------------------------

    def state_bytes(self) -> int:
        """Bytes this rank holds for optimizer state, measured on the tensors it allocated: Adam
        moments (SGD's momentum), and fp32 master weights where they are a separate copy."""
        tensors = [getattr(r, name) for r in self.ranges for name in self.STATE]
        if self.separate_master:
            tensors += [r.master for r in self.ranges]
        return sum(t.untyped_storage().nbytes() for t in tensors)

    def replicated_state_bytes(self) -> int:
        """What a replicated optimizer holds per rank for the same model (every element)."""
        return self.ddp.numel * (4 * len(self.STATE) + (4 if self.separate_master else 0))

    # -- the step --------------------------------------------------------------------------------------

    def grad_norm(self) -> float:
        """Global L2 norm of the (reduced) gradients, each parameter counted once."""
        sums = torch.zeros(2, dtype=torch.float64, device=self.ddp.grad_buffer.device)  # dense, expert
        for r in self.ranges:
            for s in r.segments:
                if s.in_norm:
                    g = r.grad[s.offset:s.offset + s.length]
                    sums[int(s.expert)] += torch.dot(g, g).double()
        comm.all_reduce(sums, self.pg.tp)
        if self.distributed:  # every DP rank holds distinct shards (of its experts' buckets: over edp)
            comm.all_reduce(sums, self.pg.dp)
        elif self.pg.ep.size > 1:  # each expert-parallel rank holds its own experts' gradients
            expert = sums[1:].clone()
            comm.all_reduce(expert, self.pg.ep)
            sums[1:] = expert
        comm.all_reduce(sums, self.pg.pp)  # every stage's parameters
        return math.sqrt(sums.sum().item())

    def found_inf(self) -> bool:
        """Whether any rank's gradients hold an inf or nan: each rank checks the ranges it steps,
        then a max over every parallel axis (TP, CP, DP, PP: the whole grid) so that every rank
        skips the same steps."""
        flag = torch.zeros(1, dtype=torch.float32, device=self.ddp.grad_buffer.device)
        for r in self.ranges:
            if not bool(torch.isfinite(r.grad).all()):
                flag.fill_(1.0)
                break
        for group in (self.pg.tp, self.pg.cp, self.pg.dp, self.pg.pp):
            comm.all_reduce(flag, group, op="max")
        return bool(flag.item())

    @torch.no_grad()
    def step(self, lr: float, decoupled_lr: float | None = None) -> tuple[float, bool]:
        """Unscale (fp16), clip, update, and (distributed) all-gather the parameters; the
        parameters given as `decoupled` step with decoupled_lr (None: lr). Returns
        (grad norm before clipping, whether the update was applied: an inf/nan gradient under
        loss scaling, or a non-finite norm, skips the step)."""
        self.ddp.finish_param_sync()  # a gather still pending (a parameter no forward used)
        if self.grad_scaler is not None:
            inv = 1.0 / self.grad_scaler.scale
            for r in self.ranges:
                r.grad.mul_(inv)
            found = self.found_inf()
            self.grad_scaler.update(found)
            if found:
                return float("nan"), False
        norm = self.grad_norm()
        if not math.isfinite(norm):
            return norm, False
        if self.clip_grad > 0:
            coeff = self.clip_grad / (norm + 1.0e-6)
            if coeff < 1.0:
                for r in self.ranges:
                    r.grad.mul_(coeff)
        self.step_count += 1
        lrs = {False: lr, True: lr if decoupled_lr is None else decoupled_lr}
        for r in self.ranges:
            self._update(r, lrs)
            if self.separate_master:
                r.param.copy_(r.master)
        if self.distributed:
            self._all_gather_params()
        return norm, True

    def _update(self, r: _Range, lrs: dict) -> None:
        """lrs: {decoupled: lr} for the range's segments."""
        raise NotImplementedError

    def _all_gather_params(self) -> None:
        # overlapped with the next forward: in the order that forward needs the buckets
        order = self.ddp.forward_order if self.overlap_param_gather else range(len(self.ranges))
        for i in order:
            bucket, r = self.ddp.buckets[i], self.ranges[i]
            # The input is this rank's part of the output: gather from a copy.
            out = self.ddp.param_buffer[bucket.start:bucket.end]
            if self.overlap_param_gather and bucket.group.size > 1:
                source = r.param.clone()
                self.ddp.param_gather_started(bucket, comm.all_gather_into_tensor(out, source, bucket.group,
                                                                                  async_op=True), source)
            else:
                comm.all_gather_into_tensor(out, r.param.clone(), bucket.group)

    # -- checkpoints -----------------------------------------------------------------------------------

    def state_dict(self) -> dict:
        return {
            "step": self.step_count,
            "distributed": self.distributed,
            "ranges": [(r.lo, r.hi) for r in self.ranges],
            **{name: [getattr(r, name).clone() for r in self.ranges] for name in self.STATE},
            "master": [r.master.clone() for r in self.ranges] if self.separate_master else None,
        }

    @torch.no_grad()
    def load_state_dict(self, state: dict) -> None:
        ranges = [tuple(x) for x in state["ranges"]]
        if ranges != [(r.lo, r.hi) for r in self.ranges] or state["distributed"] != self.distributed:
            raise ValueError("the optimizer checkpoint was written with a different model, data-parallel size "
                             "or optimizer (distributed vs replicated)")
        self.step_count = int(state["step"])
        for i, r in enumerate(self.ranges):
            for name in self.STATE:
                getattr(r, name).copy_(state[name][i])
            if self.separate_master:
                r.master.copy_(state["master"][i])
                r.param.copy_(r.master)


class Adam(FlatOptimizer):
    """AdamW (decoupled weight decay on matrices), Megatron's --optimizer adam."""

    STATE = ("exp_avg", "exp_avg_sq")

    def __init__(self, ddp: DistributedDataParallel, pg: ProcessGroups, *, distributed: bool = False,
                 weight_decay: float = 0.01, beta1: float = 0.9, beta2: float = 0.999, eps: float = 1e-8,
                 clip_grad: float = 0.0, grad_scaler=None, overlap_param_gather: bool = False, decoupled=()):
        super().__init__(ddp, pg, distributed=distributed, weight_decay=weight_decay, clip_grad=clip_grad,
                         grad_scaler=grad_scaler, overlap_param_gather=overlap_param_gather, decoupled=decoupled)
        self.beta1, self.beta2, self.eps = beta1, beta2, eps

    def _update(self, r: _Range, lrs: dict) -> None:
        # torch's fused AdamW kernel (one pass over the moments and weights; the op-by-op update
        # reads and writes each of them several times and is several times slower on the CPU),
        # called on views of the flat ranges: one list per (weight decay (matrices) or not, lr).
        # The kernel counts the step itself from `state_steps`.
        for decay, decoupled in ((True, False), (False, False), (True, True), (False, True)):
            lr = lrs[decoupled]
            views = [(s.offset, s.offset + s.length) for s in r.segments
                     if s.decay == decay and s.decoupled == decoupled]
            if not views:
                continue
            lists = [[t[a:b] for a, b in views] for t in (r.master, r.grad, r.exp_avg, r.exp_avg_sq)]
            steps = [torch.tensor(float(self.step_count - 1), device=r.master.device) for _ in views]
            adam_update(*lists, [], steps, fused=True, decoupled_weight_decay=True, amsgrad=False,
                        beta1=self.beta1, beta2=self.beta2, lr=lr,
                        weight_decay=self.weight_decay if decay else 0.0, eps=self.eps, maximize=False)


class SGD(FlatOptimizer):
    """SGD with momentum, Megatron's --optimizer sgd (torch.optim.SGD's update: L2 weight decay
    added to the gradient of matrices, buf = momentum * buf + g, the first step's buf = g)."""

    STATE = ("momentum_buffer",)

    def __init__(self, ddp: DistributedDataParallel, pg: ProcessGroups, *, distributed: bool = False,
                 weight_decay: float = 0.01, momentum: float = 0.9, clip_grad: float = 0.0, grad_scaler=None,
                 overlap_param_gather: bool = False, decoupled=()):
        super().__init__(ddp, pg, distributed=distributed, weight_decay=weight_decay, clip_grad=clip_grad,
                         grad_scaler=grad_scaler, overlap_param_gather=overlap_param_gather, decoupled=decoupled)
        self.momentum = momentum

    def _update(self, r: _Range, lrs: dict) -> None:
        g = r.grad
        if self.weight_decay > 0:
            g = g.clone()
            for s in r.segments:
                if s.decay:
                    g[s.offset:s.offset + s.length].add_(r.master[s.offset:s.offset + s.length],
                                                         alpha=self.weight_decay)
        if self.momentum > 0:
            buf = r.momentum_buffer
            if self.step_count == 1:
                buf.copy_(g)
            else:
                buf.mul_(self.momentum).add_(g)
            g = buf
        if lrs[True] == lrs[False]:
            r.master.add_(g, alpha=-lrs[False])
            return
        for s in r.segments:
            piece = slice(s.offset, s.offset + s.length)
            r.master[piece].add_(g[piece], alpha=-lrs[s.decoupled])
