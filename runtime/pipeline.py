"""Pipeline parallelism at run time: the stages of a compiled model driven by PyTorch's own
schedules (torch.distributed.pipelining), not a home-made one.

A model compiled at PP > 1 holds, on each pipeline rank, the parts of that rank's stages (its
PIPELINE_STAGES rows: the layers it owns, the embedding side on the first stage, the output side
on the last) and runs one stage per call: `model(h, stage=s, tokens=..., labels=...)`. Here each
of the rank's stages becomes a `PipelineStage` over the pipeline group, and one schedule drives
them all: GPipe, 1F1B, interleaved 1F1B (V > 1 stages per rank) or interleaved zero-bubble.

The model inputs travel as keyword arguments, which the schedule splits into micro-batches and
hands to every stage (the first reads the token ids, the last the labels: Megatron's data loader
feeds both ends); the activations between stages are the tensors the compiler listed. The model
returns its per-token loss on the last stage; the schedule's loss function averages it per
micro-batch and divides by the micro-batch count, as the PP = 1 loop's `(loss / n).backward()`
does, so gradients and the reported loss are the same numbers.

Scatter/gather over TP (Narayanan et al. 2021, Section 4.1; Megatron's
`--scatter-gather-tensors-in-pipeline`): an activation that crosses a stage boundary replicated
over the tensor-parallel ranks (TP > 1 without sequence parallelism: layout `I` on tp) is sent as
each TP rank's 1/t slice of its last dim, and the receiving stage all-gathers it over TP; the
gradient travels back as slices and is all-gathered on the sending stage. Every TP rank holds
the same activation and the same gradient, so the numbers are the unscattered run's, exactly;
each rank's pipeline link carries 1/t of the bytes. On by default (`scatter_gather=False` sends
whole tensors); a value already sharded over TP (sequence parallelism) is sent as it is.
"""

from __future__ import annotations

import contextlib
import warnings

import torch
from torch import nn

from . import comm
from .mappings import gather_from_tensor_model_parallel_region, scatter_to_tensor_model_parallel_region
from .parallel_state import ProcessGroups
from .random import RNGTracker

SCHEDULES = ("1f1b", "gpipe", "interleaved_1f1b", "interleaved_zero_bubble")


def scattered(items, tp) -> list:
    """For each p2p item of a PIPELINE_STAGES row ((name, local shape, layout, bytes)): whether it
    travels as 1/t slices of its last dim: TP > 1, the value replicated over tp (layout `I`, or
    `tp:I` among several axes) and its last dim divisible by t."""
    out = []
    for _, shape, layout, _ in items:
        axes = dict(part.split(":", 1) for part in layout.split("/")) if ":" in layout else None
        replicated = layout == "I" if axes is None else axes.get("tp") == "I"
        out.append(tp.size > 1 and replicated and bool(shape) and shape[-1] % tp.size == 0)
    return out


class _StageModule(nn.Module):
    """One stage of a model that holds several: forward runs stage `index` (inside the context
    `around(index)` gives: a meter of what it saves for backward, or nothing). With `tp` given,
    the stage's TP-replicated inputs arrive as slices, all-gathered here, and its TP-replicated
    outputs leave as this rank's slice (scattered())."""

    def __init__(self, model: nn.Module, index: int, around, row: dict | None = None, tp=None):
        super().__init__()
        self.model, self.index, self._around, self.tp = model, index, around, tp
        self.gather_in = scattered(row["recv"], tp) if tp is not None else []
        self.scatter_out = scattered(row["send"], tp) if tp is not None else []

    def forward(self, *args, **kwargs):
        if any(self.gather_in):
            args = tuple(gather_from_tensor_model_parallel_region(a, self.tp) if i < len(self.gather_in)
                         and self.gather_in[i] else a for i, a in enumerate(args))
        with self._around(self.index):
            out = self.model(*args, stage=self.index, **kwargs)
        if any(self.scatter_out):
            many = isinstance(out, tuple)
            outs = tuple(scatter_to_tensor_model_parallel_region(o, self.tp) if cut else o
                         for o, cut in zip(out if many else (out,), self.scatter_out))
            out = outs if many else outs[0]
        return out


@contextlib.contextmanager
def _rng_untouched(device: torch.device, rng_tracker: RNGTracker | None):
    """Run the block without consuming randomness: torch's generators and the tracker's streams
    are put back as they were afterwards."""
    devices = [device] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices):
        if rng_tracker is None:
            yield
        else:
            with rng_tracker.replaying(rng_tracker.snapshot()):
                yield


def _stage_class(pl):
    """torch's PipelineStage, with two changes.

    Its shape inference draws no random numbers: on its first step a stage infers the shapes it
    sends by running one forward on real tensors; with dropout that consumes the RNG streams once,
    in the first step of a run. A run resumed from a checkpoint would consume them in its first
    step (after the states were restored), where the run it continues did not, and its masks (so
    its losses) would differ from there on.

    Its last backward of the step (the schedule's `last_backward`: a stage's last micro-batch, for
    the weight half too under zero-bubble) runs inside the DistributedDataParallel's
    final_backward(), so the gradients finished there start their data-parallel reduction while
    the schedule goes on (torch's own hook for this knows only torch's DDP and FSDP). And the
    zero-bubble weight pass, which assigns `.grad` where autograd would accumulate it (so no
    post-accumulate hook runs), hands its gradients to the DDP's main_grad: without it they
    stayed in `.grad`, which the optimizer never reads."""
    infers = hasattr(pl.PipelineStage, "_forward_metadata_inference")
    if not infers:
        warnings.warn("this torch's PipelineStage infers shapes elsewhere: with dropout, a resumed pipeline run "
                      "may draw other masks than the run it continues", RuntimeWarning, stacklevel=3)

    class Stage(pl.PipelineStage):
        def __init__(self, *args, rng_tracker: RNGTracker | None = None, grad_sync=None, **kwargs):
            super().__init__(*args, **kwargs)
            self.rng_tracker, self.grad_sync = rng_tracker, grad_sync

        if infers:
            def _forward_metadata_inference(self, *args, **kwargs):
                with _rng_untouched(self.device, self.rng_tracker):
                    return super()._forward_metadata_inference(*args, **kwargs)

        def backward_maybe_with_nosync(self, backward_type, bwd_kwargs, last_backward=False):
            final = self.grad_sync.final_backward() if last_backward and self.grad_sync is not None \
                else contextlib.nullcontext()
            with final:
                out = super().backward_maybe_with_nosync(backward_type, bwd_kwargs, last_backward=last_backward)
                if backward_type == "weight" and self.grad_sync is not None:
                    self.grad_sync.take_assigned_grads()  # the weight pass sets .grad, no hook runs
            return out

    return Stage


def stages_of(model: nn.Module) -> list:
    """The PIPELINE_STAGES rows this rank's model was built for."""
    stages = getattr(model, "stages", None)
    if not stages:
        raise ValueError("the model was not compiled for pipeline parallelism (it has no `stages`)")
    return list(stages)


def default_schedule(model: nn.Module) -> str:
    return "interleaved_1f1b" if len(stages_of(model)) > 1 else "1f1b"


class Pipeline:
    """The schedule over this rank's stages of `model` (a compiled module at PP > 1).

    input_names: the model's inputs, in the spec's order (passed by name to every stage).
    rng_tracker: the model's RNG tracker, left untouched by the stages' shape inference.
    ddp: the model's runtime.ddp.DistributedDataParallel: each stage's last backward of the step
    runs in its final_backward(), so that the data-parallel reduction of the gradients finished
    there overlaps the rest of the schedule (None: every bucket is reduced after it).
    scatter_gather: send TP-replicated activations as 1/t slices, all-gathered over TP on arrival
    (the module's docstring); False sends them whole.
    `step(inputs, micro_batches)` runs forward and backward of one global batch on this DP rank
    and returns the mean loss (on every pipeline rank: the last stage's, broadcast).
    """

    def __init__(self, model: nn.Module, pg: ProcessGroups, n_microbatches: int, input_names, *,
                 schedule: str | None = None, device: torch.device | None = None,
                 rng_tracker: RNGTracker | None = None, scatter_gather: bool = True, ddp=None):
        from torch.distributed import pipelining as pl

        if pg.pp.size < 2:
            raise ValueError("a Pipeline needs a pipeline-parallel group of 2 or more ranks")
        self.model, self.pg, self.n = model, pg, n_microbatches
        self._build = dict(schedule=schedule, device=device, rng_tracker=rng_tracker,  # with_micro_batches
                           scatter_gather=scatter_gather, ddp=ddp)
        self.input_names = tuple(input_names)
        rows = stages_of(model)
        self.schedule_name = schedule or default_schedule(model)
        if self.schedule_name not in SCHEDULES:
            raise ValueError(f"unknown pipeline schedule {self.schedule_name!r}; known: {', '.join(SCHEDULES)}")
        num_stages = pg.pp.size * len(rows)
        device = device or torch.device("cpu")
        stage_class = _stage_class(pl)
        extra = {"rng_tracker": rng_tracker, "grad_sync": ddp}
        self._meter, self._metered = None, set()
        tp = pg.tp if scatter_gather and pg.tp.size > 1 else None
        self.stages = [stage_class(_StageModule(model, row["stage"], self._around, row, tp), row["stage"], num_stages,
                                   device, group=pg.pp.group, **extra) for row in rows]
        self.has_last = any(row["post_process"] for row in rows)
        self.loss_scale = 1.0  # fp16: the scale of the step being run (step(loss_scale=...))
        self.weighted = False  # step(weights=...): the target is each token's weight
        n = n_microbatches

        def loss_fn(per_token_loss, target):
            # backward starts from the scaled loss, as the PP = 1 loop's (loss * scale / n).backward():
            # the optimizer divides the gradients by the same scale
            loss = per_token_loss.float()
            if not self.weighted:  # the mean over a micro-batch's tokens, 1/m of the step
                out = loss.mean() * (self.loss_scale / n)
                out.masked_sum = loss.detach().double().sum()
            else:
                out = (loss * target).sum() * self.loss_scale
                out.masked_sum = (loss.detach() * (target != 0)).double().sum()
            # kept on the loss the schedule records for the micro-batch (the schedule may call
            # loss_fn once more on its first step, and only the recorded ones count)
            return out

        multi = len(rows) > 1
        if self.schedule_name in ("1f1b", "gpipe") and multi:
            raise ValueError(f"schedule {self.schedule_name} runs one stage per rank; this model has {len(rows)} "
                             f"per rank (interleaved): use interleaved_1f1b or interleaved_zero_bubble")
        if n_microbatches < pg.pp.size and self.schedule_name != "gpipe":
            raise ValueError(f"{n_microbatches} micro-batches are fewer than the {pg.pp.size} pipeline stages the "
                             f"{self.schedule_name} schedule needs in flight (raise the global batch)")
        # scale_grads=False: the gradients are already 1/m (loss_fn), and runtime.ddp keeps them in
        # main_grad, where the schedule's own scaling (of .grad) would not reach
        if self.schedule_name == "gpipe":
            self.schedule = pl.ScheduleGPipe(self.stages[0], n, loss_fn=loss_fn, scale_grads=False)
        elif self.schedule_name == "1f1b":
            self.schedule = pl.Schedule1F1B(self.stages[0], n, loss_fn=loss_fn, scale_grads=False)
        elif self.schedule_name == "interleaved_1f1b":
            self.schedule = pl.ScheduleInterleaved1F1B(self.stages, n, loss_fn=loss_fn, scale_grads=False)
        else:
            self.schedule = pl.ScheduleInterleavedZeroBubble(self.stages, n, loss_fn=loss_fn, scale_grads=False)

    def _kwargs(self, micro_batches: list) -> dict:
        """The global batch of this DP rank as keyword inputs: the micro-batches concatenated on
        dim 0, which the schedule splits back into the same micro-batches."""
        if len(micro_batches) != self.n:
            raise ValueError(f"expected {self.n} micro-batches, got {len(micro_batches)}")
        return {name: torch.cat([mb[i] for mb in micro_batches]) for i, name in enumerate(self.input_names)}

    def _around(self, stage: int):
        """The context a stage's forward runs in: the step's meter for the first forward of each
        stage (one micro-batch), nothing for the rest."""
        if self._meter is None or stage in self._metered:
            return contextlib.nullcontext()
        self._metered.add(stage)
        return self._meter

    def with_micro_batches(self, n: int) -> "Pipeline":
        """The same model's schedule for n micro-batches (a batch-size ramp-up)."""
        return Pipeline(self.model, self.pg, n, self.input_names, **self._build)

    def step(self, micro_batches: list, *, train: bool = True, loss_scale: float = 1.0,
             saved_meter=None, weights: torch.Tensor | None = None) -> torch.Tensor:
        """Forward (and with `train`, backward) of the micro-batches; the mean loss, a 1-element
        fp32 tensor on every pipeline rank. Gradients accumulate, multiplied by `loss_scale`
        (fp16's: the optimizer unscales); finalize them afterwards. The loss returned is unscaled.
        weights [n*b, s] (the micro-batches' concatenated): each token's weight in the loss
        instead of the mean (runtime.train.training.loss_weights), and the sum of the weighted
        losses is returned. Either way `masked_sum` holds the sum of the per-token losses whose
        weight is not 0 (1-element fp64, on every pipeline rank). saved_meter (a context,
        runtime.train.throughput.SavedActivations) measures what one micro-batch's forward keeps
        for backward on each of this rank's stages."""
        kwargs = self._kwargs(micro_batches)
        target = kwargs[self.input_names[-1]] if weights is None else weights
        losses: list = []
        self.loss_scale = float(loss_scale)
        self.weighted = weights is not None
        self._meter, self._metered = saved_meter, set()
        try:
            if train:
                self.schedule.step(target=target, losses=losses, **kwargs)
            else:
                self.schedule.eval(target=target, losses=losses, **kwargs)
        finally:
            self.loss_scale, self._meter = 1.0, None
        total = torch.zeros(2, dtype=torch.float64)
        if self.has_last:
            # in float64, so that dividing by the scale (a power of two) gives back the loss exactly
            total[0] += (torch.stack([x.detach().double() for x in losses]).sum() / loss_scale).cpu()
            total[1] += torch.stack([x.masked_sum for x in losses]).sum().cpu()
        comm.all_reduce(total, self.pg.pp)  # only the last stage holds the loss: the others add zero
        self.masked_sum = total[1:].clone()
        return total[:1].float()

    def outputs(self, micro_batches: list) -> torch.Tensor | None:
        """Forward only; the last stage's per-token loss of the whole batch (None elsewhere)."""
        kwargs = self._kwargs(micro_batches)
        with torch.no_grad():
            out = self.schedule.eval(target=kwargs[self.input_names[-1]], **kwargs)
        return out if self.has_last else None
