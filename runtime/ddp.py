"""Data parallelism: gradients reduced over the data-parallel group in buckets, overlapped with
the backward pass (Megatron's DistributedDataParallel idea, written small).

Every trainable parameter's storage is moved into one flat parameter buffer, and it gets a
`main_grad`: a view of one flat fp32 gradient buffer with the same layout. Parameters are laid
out in reverse registration order (roughly the order backward produces their gradients) and
grouped into buckets of about `bucket_size` elements; a parameter is never split between
buckets, and each bucket is padded to a multiple of the DP size so that it divides into equal
shards for a reduce-scatter.

During backward, a post-accumulate-grad hook adds each parameter's `.grad` into its
`main_grad` (accumulating in fp32 across micro-batches, whatever the parameter dtype) and drops
`.grad`. On the last micro-batch (outside `no_sync()`), once every parameter of a bucket has its
gradient, the bucket's reduction starts asynchronously while backward goes on with earlier
layers. Buckets start strictly in index order, so every rank issues the same collectives in the
same order. The gradients are averaged: each bucket is scaled by 1/DP before the sum.

Under pipeline parallelism the whole schedule runs under `no_sync()`, and each stage's last
backward of the step (its last micro-batch; a rank holds one stage per virtual chunk) runs inside
`final_backward()` (runtime.pipeline): the gradients that arrive there are final, so their buckets
start reducing while the schedule goes on with the rank's other chunks and the pipeline drains,
as Megatron's per-chunk gradient sync does. A bucket holding a weight tied across pipeline stages
(runtime.init.tie_across_stages) is held back until finalize_model_grads has summed that weight
over the embedding group: the first and the last stage lay it out at different offsets, so a
reduce-scatter shard of one covers other elements than the other's.

`grad_reduce="all_reduce"` leaves the full averaged gradient on every rank (the replicated
optimizer); `"reduce_scatter"` leaves each rank only its shard of every bucket (the distributed
optimizer steps on that shard and all-gathers the parameters back into the parameter buffer).

Expert weights of a mixture of experts (runtime.moe.is_expert_param) are replicated over the
expert-data-parallel group only (`pg.edp`, DP / EP ranks): they get buckets of their own, reduced
(or reduce-scattered) over that group, still scaled by 1/DP, since each expert-parallel rank's
experts already hold the gradient of every token routed to them.

A tied weight (word embedding and output layer) is one Parameter used twice: autograd sums both
uses into its one `.grad` before the hook runs, so it is reduced once and stays tied.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import torch
from torch import nn

from . import comm
from .init import tied_name
from .parallel_state import ProcessGroups

GRAD_REDUCE_MODES = ("all_reduce", "reduce_scatter")


@dataclass
class Bucket:
    index: int
    start: int  # offsets into the flat buffers; end - start is a multiple of the DP size
    end: int
    params: list = field(default_factory=list)
    pending: int = 0  # parameters whose gradient has not arrived in this synchronized backward
    group: object = None  # the data-parallel group it is reduced over (dp; edp for expert weights)
    launched: bool = False
    held: bool = False  # holds a weight tied across pipeline stages: starts in finish_grad_sync
    handle: object = None
    shard_out: torch.Tensor | None = None  # reduce-scatter output, copied into the buffer on finish

    def shard_range(self, dp_rank: int, dp_size: int) -> tuple[int, int]:
        size = (self.end - self.start) // dp_size
        return self.start + dp_rank * size, self.start + (dp_rank + 1) * size


def _callers(module: nn.Module) -> list:
    """(module, the parameters its forward reads) for every module with a forward of its own, in
    registration order: its own parameters and those of its descendants that have no forward
    (plain nn.Module containers that only name parameters, never called)."""
    out, index = [], {}
    for name, m in module.named_modules():
        if type(m).forward is not nn.Module.forward or not name:
            index[name] = len(out)
            out.append((m, list(m.parameters(recurse=False))))
            continue
        parent = name.rsplit(".", 1)[0] if "." in name else ""  # listed before its children
        index[name] = index[parent]  # a container's entry is its nearest caller's
        out[index[parent]][1].extend(m.parameters(recurse=False))
    return out


class DistributedDataParallel(nn.Module):
    def __init__(self, module: nn.Module, pg: ProcessGroups, *, bucket_size: int = 4_000_000,
                 grad_reduce: str = "all_reduce", overlap_grad_reduce: bool = True):
        super().__init__()
        if grad_reduce not in GRAD_REDUCE_MODES:
            raise ValueError(f"grad_reduce must be one of {GRAD_REDUCE_MODES}, got {grad_reduce!r}")
        if bucket_size < 1:
            raise ValueError(f"bucket_size must be at least 1, got {bucket_size}")
        self.module = module
        self.pg = pg
        self.dp = pg.dp
        self.grad_reduce = grad_reduce
        self.overlap_grad_reduce = overlap_grad_reduce
        params = [p for p in module.parameters() if p.requires_grad]  # a shared parameter once
        if not params:
            raise ValueError("the module has no trainable parameters")
        dtypes = {p.dtype for p in params}
        devices = {p.device for p in params}
        if len(dtypes) != 1 or len(devices) != 1:
            raise ValueError(f"all parameters must share one dtype and device, got {dtypes} on {devices}")
        self.param_dtype = params[0].dtype
        device = params[0].device

        # Layout: reverse registration order, buckets of about bucket_size, padded to their group's
        # size; expert weights in buckets of their own (after the dense ones).
        from .moe import is_expert_param

        dense = [p for p in reversed(params) if not is_expert_param(p)]
        experts = [p for p in reversed(params) if is_expert_param(p)]
        self.params = dense + experts
        self.buckets: list[Bucket] = []
        self.param_range: dict[nn.Parameter, tuple[int, int]] = {}
        self._bucket_of: dict[nn.Parameter, Bucket] = {}
        offset = 0
        for group, members in ((pg.dp, dense), (pg.edp, experts)):
            current = Bucket(index=len(self.buckets), start=offset, end=offset, group=group)
            for p in members:
                self.param_range[p] = (offset, offset + p.numel())
                current.params.append(p)
                self._bucket_of[p] = current
                offset += p.numel()
                if offset - current.start >= bucket_size:
                    offset = self._close(current, offset)
                    current = Bucket(index=len(self.buckets), start=offset, end=offset, group=group)
            if current.params:
                offset = self._close(current, offset)
        self.numel = offset

        self.param_buffer = torch.zeros(self.numel, dtype=self.param_dtype, device=device)
        self.grad_buffer = torch.zeros(self.numel, dtype=torch.float32, device=device)
        with torch.no_grad():
            for p in self.params:
                lo, hi = self.param_range[p]
                view = self.param_buffer[lo:hi].view_as(p)
                view.copy_(p.data)
                p.data = view
                p.main_grad = self.grad_buffer[lo:hi].view_as(p)
                p.grad = None
        embd = getattr(pg, "embd", None)
        if embd is not None and embd.size > 1:
            for p in self.params:
                if tied_name(p) is not None:
                    self._bucket_of[p].held = True
        self._sync = True
        self._final = False  # inside a pipeline stage's last backward of the step (final_backward)
        self._counted: set = set()  # parameters whose final gradient of the step has arrived
        self._hooks = [p.register_post_accumulate_grad_hook(self._grad_ready) for p in self.params]
        # The distributed optimizer's parameter all-gathers when overlapped with the next forward
        # (--overlap-param-gather): bucket index -> its pending gather, waited for by a forward
        # pre-hook on each module that holds a parameter of that bucket. A module without a forward
        # of its own (a plain nn.Module that only names parameters, as the grouped experts'
        # `linear_fc1.weight`) is never called: the nearest ancestor with a forward, whose forward
        # reads them, waits for its parameters.
        self._param_gathers: dict = {}
        first_use: dict = {}
        for m, held in _callers(module):
            own = sorted({self._bucket_of[p].index for p in held if p in self._bucket_of})
            if own:
                self._hooks.append(m.register_forward_pre_hook(self._param_hook(own)))
            for i in own:
                first_use.setdefault(i, len(first_use))
        # The order a forward reaches the buckets: by the first module (in registration order, which
        # a model's forward follows) that holds one of their parameters. The buckets themselves are
        # in reverse order (backward's), so the first module's parameters are in the last bucket;
        # the optimizer starts the overlapped gathers in this order, so that the first forward
        # waits for one bucket's gather, not for all of them (collectives of a group run in order).
        self.forward_order = sorted(range(len(self.buckets)), key=lambda i: (first_use.get(i, len(self.buckets)), i))
        self._next_launch = 0
        self._reset_buckets()

    def _close(self, bucket: Bucket, offset: int) -> int:
        size = bucket.group.size
        padded = bucket.start + -(-(offset - bucket.start) // size) * size
        bucket.end = padded
        self.buckets.append(bucket)
        return padded

    # -- the forward is the module's ---------------------------------------------------------------

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    # -- backward: hooks and buckets ------------------------------------------------------------------

    @contextlib.contextmanager
    def no_sync(self):
        """Accumulate gradients (micro-batches before the last) without reducing them."""
        previous, self._sync = self._sync, False
        try:
            yield
        finally:
            self._sync = previous

    @contextlib.contextmanager
    def final_backward(self):
        """A pipeline stage's last backward of the step, while the schedule runs under no_sync():
        the gradients that arrive in it are final, and a bucket whose parameters all have theirs
        starts reducing (runtime.pipeline enters this for each stage's last micro-batch)."""
        previous, self._final = self._final, True
        try:
            yield
        finally:
            self._final = previous

    def take_assigned_grads(self) -> None:
        """Take the gradients that were assigned to `.grad` rather than accumulated by autograd
        (torch's zero-bubble weight pass, stage_backward_weight, sets .grad itself, and no
        post-accumulate hook runs) into main_grad, as the hook does."""
        for p in self.params:
            if p.grad is not None:
                self._grad_ready(p)

    def _grad_ready(self, p: nn.Parameter) -> None:
        bucket = self._bucket_of[p]
        if bucket.launched:
            raise RuntimeError("a gradient arrived for a bucket that is already being reduced: run every "
                               "micro-batch but the last under ddp.no_sync(), and call finish_grad_sync() "
                               "(finalize_model_grads) once per step")
        p.main_grad.add_(p.grad)
        p.grad = None
        if (self._sync or self._final) and p not in self._counted:
            self._counted.add(p)
            bucket.pending -= 1
            if self.overlap_grad_reduce:
                self._launch_ready()

    def _launch_ready(self) -> None:
        """Start the buckets that are complete, in index order (the same order on every rank of
        the group); a held bucket is passed over, and starts in finish_grad_sync."""
        while self._next_launch < len(self.buckets):
            bucket = self.buckets[self._next_launch]
            if bucket.held:
                self._next_launch += 1
            elif bucket.pending <= 0:
                self._launch(bucket)
            else:
                break

    def _launch(self, bucket: Bucket) -> None:
        bucket.launched = True
        self._next_launch = bucket.index + 1
        if self.dp.size == 1:
            return
        group = bucket.group
        flat = self.grad_buffer[bucket.start:bucket.end]
        flat.mul_(1.0 / self.dp.size)  # the mean over DP, for expert weights too
        if group.size == 1:
            return
        if self.grad_reduce == "all_reduce":
            bucket.handle = comm.all_reduce(flat, group, async_op=True)
        else:
            bucket.shard_out = torch.empty((bucket.end - bucket.start) // group.size, dtype=flat.dtype,
                                           device=flat.device)
            bucket.handle = comm.reduce_scatter_tensor(bucket.shard_out, flat, group, async_op=True)

    # -- the distributed optimizer's parameter all-gather, overlapped with the next forward ----------

    def param_gather_started(self, bucket: Bucket, handle, source: torch.Tensor) -> None:
        """The optimizer started `bucket`'s parameter all-gather (async) from `source` (kept alive
        until it is waited for): the first forward of a module using that bucket's parameters
        waits for it."""
        if handle is not None:
            self._param_gathers[bucket.index] = (handle, source)

    def _param_hook(self, indices: list):
        def wait(module, args):
            for i in indices:
                pending = self._param_gathers.pop(i, None)
                if pending is not None:
                    pending[0].wait()
        return wait

    def param_gather_pending(self) -> list:
        return sorted(self._param_gathers)

    def finish_param_sync(self) -> None:
        """Wait for every pending parameter all-gather (before parameters are read outside a
        forward: a checkpoint, the next optimizer step)."""
        for i in sorted(self._param_gathers):
            self._param_gathers.pop(i)[0].wait()

    def finish_grad_sync(self) -> None:
        """Start the buckets not yet started (all of them without overlap; those holding a
        parameter that got no gradient), then wait for every reduction."""
        for bucket in self.buckets:
            if not bucket.launched:
                self._launch(bucket)
        for bucket in self.buckets:
            if bucket.handle is not None:
                bucket.handle.wait()
            if bucket.shard_out is not None:
                lo, hi = bucket.shard_range(bucket.group.rank, bucket.group.size)
                self.grad_buffer[lo:hi].copy_(bucket.shard_out)
        self._reset_buckets()

    def _reset_buckets(self) -> None:
        for bucket in self.buckets:
            bucket.pending = len(bucket.params)
            bucket.launched = False
            bucket.handle = None
            bucket.shard_out = None
        self._next_launch = 0
        self._counted = set()

    def zero_grad_buffer(self) -> None:
        """Start a new step: zero the fp32 gradients (and any stray .grad)."""
        self.grad_buffer.zero_()
        for p in self.params:
            p.grad = None
        self._reset_buckets()

    def grad_shard_ranges(self) -> list[tuple[int, int]]:
        """The buffer ranges whose reduced gradient this rank holds after finish_grad_sync."""
        if self.grad_reduce == "all_reduce":
            return [(b.start, b.end) for b in self.buckets]
        return [b.shard_range(b.group.rank, b.group.size) for b in self.buckets]
