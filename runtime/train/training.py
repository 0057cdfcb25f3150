"""The training loop, Megatron's shape in small: setup_model_and_optimizer builds the compiled
model (from the generated source and spec the caller compiled: specc_torch.train_compile.compile_model),
its DistributedDataParallel wrapper and the optimizer; train owns the iterations, logging,
evaluation and checkpoints; train_step runs one global batch (gradient accumulation over
micro-batches) through a forward_step function chosen per model type; evaluate averages the
validation loss. The model definition (a compiled spec) and its parallelization (already in the
generated code) stay out of here: the loop sees a module that maps a micro-batch to a loss.
"""

from __future__ import annotations

import contextlib
import functools
import resource
import time
from dataclasses import dataclass
from typing import Callable

import torch
import torch.distributed as dist

from .. import api, comm, moe
from ..compile import compile_layers
from ..ddp import DistributedDataParallel
from ..grads import finalize_model_grads
from ..layers import PositionEmbedding, VocabParallelEmbedding
from ..optim import SGD, Adam, ConstantGradScaler, DynamicGradScaler, FlatOptimizer, LRSchedule
from ..parallel_state import ProcessGroups
from ..random import RNGTracker
from .config import TrainConfig, lr_step, schedule_steps
from .throughput import SavedActivations, tensor_bytes

# -- forward steps, one per model type -----------------------------------------------------------------

def lm_forward_step(model, batch, n_inputs: int = 2) -> torch.Tensor:
    """A language model whose forward(tokens, labels) returns the per-token loss [b, s] (or the
    loss first and then other values, such as the logits): that loss, fp32. A micro-batch is the
    model's n_inputs inputs in the spec's order (tokens first, labels last; packed documents put
    position_ids and document_ids between them), then, if any, a loss mask (loss_weights weighs
    the tokens)."""
    out = model(*batch[:n_inputs])
    return (out[0] if isinstance(out, tuple) else out).float()


def _lm_with(*packed: str):
    """The forward step of a language model that also takes packed documents' inputs."""
    return ("tokens", *packed, "labels"), functools.partial(lm_forward_step, n_inputs=2 + len(packed))


# --reset-position-ids and --reset-attention-mask add position_ids and document_ids (specc/frontend/packed.py)
FORWARD_STEPS: dict[tuple, Callable] = dict([(("tokens", "labels"), lm_forward_step), _lm_with("position_ids"),
                                              _lm_with("document_ids"), _lm_with("position_ids", "document_ids")])


def forward_step_for(spec) -> Callable:
    names = tuple(i.name for i in spec.inputs)
    if names not in FORWARD_STEPS:
        known = ", ".join("(" + ", ".join(k) + ")" for k in FORWARD_STEPS)
        raise ValueError(f"no forward_step for a model with inputs ({', '.join(names)}); known: {known}")
    return FORWARD_STEPS[names]


# -- setup ---------------------------------------------------------------------------------------------

@dataclass
class Setup:
    model: torch.nn.Module  # the compiled module
    ddp: DistributedDataParallel
    optimizer: FlatOptimizer  # Adam or SGD
    schedule: LRSchedule
    spec: object  # the compiled spec: spec.config is the resolved model config
    rng_tracker: RNGTracker
    device: torch.device
    forward_step: Callable
    pipeline: object = None  # runtime.pipeline.Pipeline at PP > 1: the schedule that runs every micro-batch
    # --decoupled-lr: the word embedding's and output layer's schedule (None: they follow `schedule`)
    decoupled_schedule: LRSchedule | None = None


def resolve_device(name: str, local_rank: int = 0) -> torch.device:
    if name == "cuda" or (name == "auto" and torch.cuda.is_available()):
        return torch.device("cuda", local_rank % max(torch.cuda.device_count(), 1))
    return torch.device("cpu")


def setup_model_and_optimizer(cfg: TrainConfig, pg: ProcessGroups, device: torch.device | None = None, *,
                              compiled: tuple, model_file: str | None = None) -> Setup:
    """compiled: (generated model source, compiled spec) of cfg's spec at cfg's parallel settings
    (specc_torch.train_compile.compile_model(cfg)); the loop compiles nothing itself. model_file: that
    source written to a file (the run directory's model.py), imported from there so that a
    traceback inside the model shows its lines."""
    device = device or torch.device("cpu")
    source, spec = compiled
    module = api.load_module_from_file(model_file) if model_file else api.load_module_from_source(source, spec.name)
    rng = RNGTracker(cfg.seed, pg.tp.rank, cp_rank=pg.cp.rank)  # CP ranks' tokens get their own masks
    model = module.build_model(pg, seed=cfg.seed, rng_tracker=rng).to(device)
    if cfg.bf16 or cfg.fp16:
        model = model.to(torch.bfloat16 if cfg.bf16 else torch.float16)  # the optimizer keeps fp32 master weights
    if cfg.torch_compile:
        compile_layers(model, cfg.torch_compile)  # in place: parameter names and objects unchanged
    opt = cfg.optimizer
    ddp = DistributedDataParallel(model, pg, bucket_size=opt.bucket_size,
                                  grad_reduce="reduce_scatter" if opt.use_distributed_optimizer else "all_reduce",
                                  overlap_grad_reduce=opt.overlap_grad_reduce)
    common = dict(distributed=opt.use_distributed_optimizer, weight_decay=opt.weight_decay, clip_grad=opt.clip_grad,
                  grad_scaler=grad_scaler(cfg), overlap_param_gather=opt.overlap_param_gather,
                  decoupled=embedding_and_output_weights(model, spec.config["vocab_size"])
                  if opt.decoupled_lr is not None else ())
    if opt.optimizer == "sgd":
        optimizer = SGD(ddp, pg, momentum=opt.sgd_momentum, **common)
    else:
        optimizer = Adam(ddp, pg, beta1=opt.adam_beta1, beta2=opt.adam_beta2, eps=opt.adam_eps, **common)
    warmup, decay, wsd = schedule_steps(cfg)
    schedule = LRSchedule(opt.lr, opt.min_lr, warmup, decay, cfg.schedule.lr_decay_style, wsd,
                          cfg.schedule.lr_wsd_decay_style)
    decoupled = None
    if opt.decoupled_lr is not None:  # Megatron: the same schedule between their own max and min
        decoupled = LRSchedule(opt.decoupled_lr, opt.decoupled_min_lr if opt.decoupled_min_lr is not None
                               else opt.min_lr, warmup, decay, cfg.schedule.lr_decay_style, wsd,
                               cfg.schedule.lr_wsd_decay_style)
    pipeline = None
    if pg.pp.size > 1:
        from ..pipeline import Pipeline

        pipeline = Pipeline(model, pg, cfg.num_micro_batches, [i.name for i in spec.inputs],
                            schedule=cfg.parallel.pp_schedule, device=device, rng_tracker=rng, ddp=ddp)
    return Setup(model, ddp, optimizer, schedule, spec, rng, device, forward_step_for(spec), pipeline, decoupled)


def embedding_and_output_weights(model: torch.nn.Module, vocab_size: int) -> list:
    """Megatron's is_embedding_or_output_parameter on this rank's stages: the word embedding's
    table (the embedding op's VocabParallelEmbedding) and the output layer's weight (a matrix
    onto the vocabulary: `vocab_size` full output rows); one Parameter when they are tied."""
    out = {}
    for m in model.modules():
        weight = getattr(m, "weight", None)
        meta = getattr(weight, "_specc_init", None)
        if isinstance(m, VocabParallelEmbedding) or (
                not isinstance(m, PositionEmbedding) and isinstance(weight, torch.nn.Parameter) and weight.dim() == 2 and meta is not None
                and tuple(meta.full_shape)[0] == vocab_size):
            out[id(weight)] = weight
    return list(out.values())


def grad_scaler(cfg: TrainConfig):
    """fp16's loss scaler (None without --fp16): a fixed --loss-scale, else dynamic."""
    if not cfg.fp16:
        return None
    ls = cfg.loss_scale
    if ls.loss_scale is not None:
        return ConstantGradScaler(ls.loss_scale)
    return DynamicGradScaler(ls.initial_loss_scale, ls.min_loss_scale, growth_interval=ls.loss_scale_window,
                             hysteresis=ls.hysteresis)


@torch.no_grad()
def reload_master_weights(optimizer: FlatOptimizer) -> None:
    """After the model's weights were replaced (a weights-only checkpoint): the optimizer's fp32
    master weights, a separate copy when the parameters are bf16, start from them again.
    Without this the first step would write the old masters back over the loaded weights."""
    if optimizer.separate_master:
        for r in optimizer.ranges:
            r.master.copy_(r.param)


# -- one step ------------------------------------------------------------------------------------------

@dataclass
class StepResult:
    loss: float  # mean over the global batch (all micro-batches, all DP ranks)
    grad_norm: float
    applied: bool  # False: a non-finite gradient norm skipped the update
    aux_losses: dict = None  # MoE auxiliary losses (load_balancing_loss, z_loss), summed over layers, mean as loss


def _autocast(setup: Setup, bf16: bool):
    """bf16 autocast (bf16 True), or fp16 autocast when the parameters are fp16 (--fp16)."""
    if setup.ddp.param_dtype == torch.float16:
        return torch.autocast(device_type=setup.device.type, dtype=torch.float16)
    if not bf16:
        return contextlib.nullcontext()
    return torch.autocast(device_type=setup.device.type, dtype=torch.bfloat16)


def loss_weights(micro_batches: list, pg: ProcessGroups, per_token: bool, device, n_inputs: int = 2) -> tuple:
    """How each micro-batch's per-token loss enters the step, as Megatron's forward_step and
    finalize_model_grads: (weights, loss tokens of the global batch). A micro-batch's loss mask
    follows its n_inputs model inputs (every token counts without one). weights[m] is None (the mean of
    micro-batch m, 1/n of the step: no mask, not per token) or a [b, s] tensor: mask / (its
    loss tokens x n), or with `per_token` mask x DP / (the global batch's loss tokens, over all
    micro-batches and DP ranks; the gradient reduction averages over DP). The global count
    is known from the data before any forward: one all-reduce of one number."""
    n = len(micro_batches)
    masks = [_loss_mask(b, n_inputs) for b in micro_batches]
    masks = [m.float() if m is not None else None for m in masks]
    counts = [m.sum() if m is not None else torch.tensor(float(b[0].numel()), device=device)
              for m, b in zip(masks, micro_batches)]
    total = torch.stack(counts).sum().reshape(1).to(device=device, dtype=torch.float64)
    if pg.dp.size > 1:
        comm.all_reduce(total, pg.dp)
    tokens = total.item()
    if per_token:
        weights = [(m if m is not None else torch.ones(b[0].shape, device=device)) * (pg.dp.size / max(tokens, 1.0))
                   for m, b in zip(masks, micro_batches)]
    else:  # Megatron clamps a micro-batch's count at 1: all of it masked weighs nothing
        weights = [None if m is None else m / (c.clamp(min=1.0) * n) for m, c in zip(masks, counts)]
    return weights, tokens


def _loss_mask(batch, n_inputs: int):
    """A micro-batch's loss mask: the element after its n_inputs model inputs, or None."""
    return batch[n_inputs] if len(batch) > n_inputs else None


def train_step(setup: Setup, micro_batches: list, lr: float, pg: ProcessGroups, bf16: bool = False,
               saved_meter=None, per_token_loss: bool = False, decoupled_lr: float | None = None) -> StepResult:
    """Forward and backward every micro-batch (gradients accumulate in the DDP's fp32 buffer;
    only the last one starts the bucketed data-parallel reduction), finalize the gradients
    (DP reduction, TP-partial sums), then clip and step. A micro-batch is (tokens, labels) or
    (tokens, labels, loss mask); its loss weighs into the step as loss_weights says
    (per_token_loss: Megatron's --calculate-per-token-loss). The reported loss is Megatron's:
    the sum of the masked per-token losses over the global batch, divided by their count.
    saved_meter (a throughput.SavedActivations) measures what the first micro-batch's forward
    keeps; decoupled_lr: the optimizer's decoupled parameters' lr."""
    ddp = setup.ddp
    ddp.zero_grad_buffer()
    n = len(micro_batches)
    scaler = setup.optimizer.grad_scaler
    scale = scaler.scale if scaler is not None else 1.0  # fp16: the optimizer unscales
    n_inputs = len(setup.spec.inputs)
    weights, tokens = loss_weights(micro_batches, pg, per_token_loss, setup.device, n_inputs)
    # the auxiliary losses weigh as the LM loss of a micro-batch: 1/n, or per token as Megatron's
    # (unscaled per micro-batch, then the gradients over the global batch's tokens; DP averages)
    moe.set_aux_loss_scale(setup.model, scale * pg.dp.size / max(tokens, 1.0) if per_token_loss else scale / n)
    masked = torch.zeros((), dtype=torch.float64, device=setup.device)  # the sum of the masked per-token losses
    aux: dict = {}  # the MoE auxiliary losses, mean over the micro-batches
    if setup.pipeline is not None:
        # the schedule runs every micro-batch's forward and backward on this rank's stages; each
        # stage's last backward starts the data-parallel reduction of the gradients it finished
        # (Pipeline's ddp), a weight tied across stages after the tied sum (finalize_model_grads)
        pipeline = pipeline_for(setup, n)
        with ddp.no_sync(), _autocast(setup, bf16):
            pipeline.step(micro_batches, loss_scale=scale, saved_meter=saved_meter,
                          weights=None if all(w is None for w in weights) else _whole(weights, micro_batches))
        masked += pipeline.masked_sum.to(setup.device).double().reshape(())
        micro_batches = []
    for i, batch in enumerate(micro_batches):
        with contextlib.nullcontext() if i == n - 1 else ddp.no_sync():
            with _autocast(setup, bf16), saved_meter if i == 0 and saved_meter is not None else contextlib.nullcontext():
                per_token = setup.forward_step(ddp, batch)
            if weights[i] is None:  # as the pipeline's loss_fn: the mean, 1/n of the step
                (per_token.mean() * (scale / n)).backward()
            else:
                ((per_token * weights[i]).sum() * scale).backward()
        mask = _loss_mask(batch, n_inputs)
        masked += (per_token.detach() if mask is None else per_token.detach() * mask).double().sum()
        for name, value in moe.aux_losses(setup.model).items():
            aux[name] = aux.get(name, 0.0) + value / n
    finalize_model_grads(setup.model, pg, ddp)
    grad_norm, applied = setup.optimizer.step(lr) if decoupled_lr is None else setup.optimizer.step(lr, decoupled_lr)
    if applied:
        moe.update_expert_biases(setup.model, pg.dp)
    # A CP model returns the whole sequence's per-token loss on every CP rank (it gathers it):
    # the loss is reduced over DP only, never over CP.
    if pg.dp.size > 1:
        comm.all_reduce(masked, pg.dp)
    aux_means = {}
    if aux:  # each CP rank holds its tokens' part: summed over CP, then the mean over DP
        names = sorted(aux)
        values = torch.stack([torch.as_tensor(aux[k], dtype=torch.float32) for k in names]).to(setup.device)
        comm.all_reduce(values, pg.cp)
        comm.all_reduce(values, pg.dp)
        aux_means = {k: v / pg.dp.size for k, v in zip(names, values.tolist())}
    return StepResult(masked.item() / tokens if tokens else float("nan"), grad_norm, applied, aux_means)


def _whole(weights: list, micro_batches: list) -> torch.Tensor:
    """The per-micro-batch weights of a pipeline step as one [n*b, s] tensor (a mean is mask-free
    weights of 1 / (tokens x n))."""
    return torch.cat([w if w is not None else torch.full(b[0].shape, 1.0 / (b[0].numel() * len(micro_batches)),
                                                         device=b[0].device)
                      for w, b in zip(weights, micro_batches)])


def pipeline_for(setup: Setup, n: int):
    """The pipeline schedule for n micro-batches: a batch-size ramp-up changes n, and torch's
    schedules are built for one n (the stages wrap the same model)."""
    if setup.pipeline.n == n:
        return setup.pipeline
    if not hasattr(setup, "_pipelines"):
        setup._pipelines = {}
    if n not in setup._pipelines:
        setup._pipelines[n] = setup.pipeline.with_micro_batches(n)
    return setup._pipelines[n]


@torch.no_grad()
def evaluate(setup: Setup, dataset, cfg: TrainConfig, pg: ProcessGroups) -> float:
    """Loss over the first eval_iters global batches of `dataset` (the same samples at every
    evaluation, so the curve compares like with like): Megatron's, the sum of the masked
    per-token losses over all of them, divided by their count."""
    setup.model.eval()
    total = torch.zeros(2, dtype=torch.float64, device=setup.device)  # masked loss sum, loss tokens
    n_inputs = len(setup.spec.inputs)
    try:
        for it in range(cfg.eval_iters):
            batches = [micro_batch(dataset, it * cfg.global_batch_size, m, cfg, pg, setup.device)
                       for m in range(cfg.num_micro_batches)]
            for b in batches:
                mask = _loss_mask(b, n_inputs)
                total[1] += float(mask.sum()) if mask is not None else b[0].numel()
            if setup.pipeline is not None:
                weights, _ = loss_weights(batches, pg, False, setup.device, n_inputs)
                with _autocast(setup, cfg.bf16):
                    setup.pipeline.step(batches, train=False, weights=_whole(weights, batches))
                total[0] += setup.pipeline.masked_sum.double().to(setup.device).reshape(())
                continue
            for b in batches:
                with _autocast(setup, cfg.bf16):
                    per_token = setup.forward_step(setup.model, b)
                mask = _loss_mask(b, n_inputs)
                total[0] += (per_token if mask is None else per_token * mask).double().sum()
    finally:
        setup.model.train()
    if pg.dp.size > 1:
        comm.all_reduce(total, pg.dp)
    return total[0].item() / total[1].item() if total[1].item() else float("nan")


def micro_batch(dataset, consumed: int, micro: int, cfg: TrainConfig, pg: ProcessGroups, device):
    """This DP rank's micro-batch, full [b, s]: TP and CP ranks of one DP rank read the same
    samples (a CP model scatters them to the rank's load-balanced chunks itself). The model's
    inputs in the spec's order: (tokens, labels), with --reset-position-ids and
    --reset-attention-mask the position and document ids between them (packed_documents); then,
    with --eod-mask-loss, the loss mask: 0 where the input token is the end-of-document token.
    All as Megatron's get_ltor_masks_and_position_ids."""
    tokens, labels = dataset.micro_batch(consumed, micro, cfg.micro_batch_size, pg.dp.rank, pg.dp.size)
    tokens = torch.from_numpy(tokens).to(device, non_blocking=True)
    labels = torch.from_numpy(labels).to(device, non_blocking=True)
    data = cfg.data
    out = (tokens,)
    if data.reset_position_ids or data.reset_attention_mask:
        positions, documents = packed_documents(tokens, data.eod)
        out += ((positions,) if data.reset_position_ids else ()) + ((documents,) if data.reset_attention_mask else ())
    out += (labels,)
    if data.eod_mask_loss:
        out += ((tokens != data.eod).float(),)
    return out


def packed_documents(tokens: torch.Tensor, eod: int) -> tuple:
    """(position ids, document ids) of packed samples [b, s], as Megatron's
    get_ltor_masks_and_position_ids reads them: an end-of-document token ends its document (it
    belongs to the document before it), the next token starts another at position 0. Document
    ids count the end-of-document tokens before a token in its sample."""
    ends = (tokens == eod).long()
    documents = ends.cumsum(-1) - ends
    index = torch.arange(tokens.shape[-1], device=tokens.device).expand_as(tokens)
    starts = torch.zeros_like(index)
    starts[:, 1:] = torch.where(ends[:, :-1].bool(), index[:, 1:], 0)  # a document starts after each end
    return index - starts.cummax(-1).values, documents


def max_memory_mb(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


# -- the loop ------------------------------------------------------------------------------------------

@dataclass
class TrainState:
    iteration: int = 0
    consumed_samples: int = 0


def measured_memory(setup: Setup, saved: SavedActivations) -> dict:
    """What this rank holds after a step, in bytes, by what holds it: the model's parameters, the
    DDP's fp32 gradient buffer, the optimizer's state (Adam moments, separate fp32 masters) and
    the activations the first micro-batch's forward kept for backward."""
    params = {p.untyped_storage().data_ptr(): p.untyped_storage().nbytes() for p in setup.model.parameters()}
    return {"parameters": sum(params.values()), "gradients": tensor_bytes(setup.ddp.grad_buffer),
            "optimizer": setup.optimizer.state_bytes(), "activations": saved.total}


def _past(started: float, minutes: float, device) -> bool:
    """Whether any rank has trained for more than `minutes` since `started` (Megatron's
    --exit-duration-in-mins): the ranks' clocks differ, so they agree on the slowest one's (MAX),
    and all stop after the same iteration."""
    past = torch.tensor([1.0 if (time.monotonic() - started) / 60.0 > minutes else 0.0], device=device)
    if dist.is_available() and dist.is_initialized():
        dist.all_reduce(past, op=dist.ReduceOp.MAX)
    return bool(past.item())


def train(setup: Setup, datasets: dict, cfg: TrainConfig, pg: ProcessGroups, reporter, state: TrainState,
          save_fn: Callable | None = None, before_step: Callable[[int], None] | None = None,
          flops_per_iteration: int | None = None, after_first_step: Callable[[dict], None] | None = None) -> list:
    """Run iterations state.iteration+1 .. train_iters; returns the per-iteration losses.
    save_fn(state) saves a checkpoint; before_step(iteration) runs before each iteration.
    flops_per_iteration: this rank's FLOPs in one iteration of the full global batch (the
    compiled plan's, all its micro-batches), for TFLOP/s and MFU; after_first_step(measured_memory)
    runs after the first iteration of this run. With --rampup-batch-size each iteration's global
    batch follows the samples consumed (cfg.batch_size_at), and, as Megatron, a checkpoint is
    saved (with save_fn) before the first iteration of each new batch size."""
    losses = []
    first = True
    seq = setup.spec.config["seq_length"]
    evaluated_at = saved_at = None
    batch_size = cfg.batch_size_at(state.consumed_samples)
    started = time.monotonic()  # --exit-duration-in-mins counts from here
    while state.iteration < cfg.train_iters:
        iteration = state.iteration + 1
        if cfg.batch_size_at(state.consumed_samples) != batch_size:
            batch_size = cfg.batch_size_at(state.consumed_samples)
            reporter.info(f"ramping up the global batch to {batch_size} after {state.consumed_samples} samples "
                          "(--rampup-batch-size)")
            if save_fn is not None and cfg.checkpoint.save is not None and saved_at != state.iteration:
                save_fn(state)
                saved_at = state.iteration
        n = batch_size // (cfg.micro_batch_size * pg.dp.size)
        if before_step is not None:
            before_step(iteration)
        lr_at = lr_step(cfg, iteration, state.consumed_samples + batch_size)
        lr = setup.schedule(lr_at)
        decoupled_lr = setup.decoupled_schedule(lr_at) if setup.decoupled_schedule is not None else None
        start = time.perf_counter()
        batches = [micro_batch(datasets["train"], state.consumed_samples, m, cfg, pg, setup.device) for m in range(n)]
        meter = SavedActivations(setup.model.parameters()) if first and after_first_step is not None else None
        result = train_step(setup, batches, lr, pg, cfg.bf16, saved_meter=meter,
                            per_token_loss=cfg.calculate_per_token_loss, decoupled_lr=decoupled_lr)
        if setup.device.type == "cuda":
            torch.cuda.synchronize(setup.device)
        step_time = time.perf_counter() - start
        state.iteration = iteration
        state.consumed_samples += batch_size
        losses.append(result.loss)
        scaler = setup.optimizer.grad_scaler
        reporter.train(iteration=iteration, consumed_samples=state.consumed_samples, lr=lr, loss=result.loss,
                       grad_norm=result.grad_norm, step_time=step_time, tokens=batch_size * seq,
                       batch_size=batch_size, memory_mb=max_memory_mb(setup.device),
                       skipped=not result.applied,
                       flops=flops_per_iteration // cfg.num_micro_batches * n if flops_per_iteration else None,
                       loss_scale=scaler.scale if scaler is not None else 1.0,
                       **({"aux_losses": result.aux_losses} if result.aux_losses else {}))
        if meter is not None:
            after_first_step(measured_memory(setup, meter))
        first = False
        if cfg.eval_iters > 0 and iteration % cfg.eval_interval == 0:
            reporter.evaluation(iteration=iteration, loss=evaluate(setup, datasets["valid"], cfg, pg),
                                consumed_samples=state.consumed_samples)
            evaluated_at = iteration
        if save_fn is not None and cfg.checkpoint.save_interval and iteration % cfg.checkpoint.save_interval == 0:
            save_fn(state)
            saved_at = iteration
        if cfg.exit_interval and iteration % cfg.exit_interval == 0:
            reporter.info(f"exiting after iteration {iteration} (--exit-interval {cfg.exit_interval})")
            break
        if cfg.exit_duration_in_mins is not None and _past(started, cfg.exit_duration_in_mins, setup.device):
            reporter.info(f"exiting after iteration {iteration}: the run has trained for more than "
                          f"--exit-duration-in-mins {cfg.exit_duration_in_mins:g}")
            break
    setup.ddp.finish_param_sync()  # --overlap-param-gather: the last step's gathers, before anyone reads
    if cfg.eval_iters > 0 and evaluated_at != state.iteration:
        reporter.evaluation(iteration=state.iteration, loss=evaluate(setup, datasets["valid"], cfg, pg),
                            consumed_samples=state.consumed_samples)
    return losses
