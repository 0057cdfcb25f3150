"""Training configuration as plain dataclasses, and the rules checked before any rank starts.

The command line (specc_cli/train.py, Megatron's flag names) fills these; nothing here
reads globals or the environment. `validate` returns every broken rule as one line, so the
launcher can print them all and exit before torchrun starts a single process.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

from ..cpu.host_memory import MODES as HOST_MEMORY_MODES

DECAY_STYLES = ("constant", "linear", "cosine", "WSD")
WSD_DECAY_STYLES = ("linear", "cosine", "exponential", "minus_sqrt")
OPTIMIZERS = ("adam", "sgd")
CP_COMM_TYPES = ("auto", "p2p", "all_gather")


@dataclass
class ParallelConfig:
    tp: int = 1
    sp: bool = False
    cp: int = 1
    cp_comm_type: str = "auto"  # attention over the CP group: auto (the cost model), p2p (ring), all_gather
    pp: int = 1
    pp_virtual_stage_layers: int | None = None  # interleaved: layers per virtual stage
    pp_first_stage_layers: int | None = None
    pp_last_stage_layers: int | None = None
    pp_layout: str | None = None
    pp_schedule: str | None = None  # runtime.pipeline.SCHEDULES; None: 1f1b (interleaved_1f1b with V > 1)
    dp: int = 1  # derived from the world size by `resolve`
    ep: int = 1  # expert-model-parallel: carved out of the DP ranks (Megatron), so it must divide dp
    etp: int | None = None  # expert-tensor-parallel: must equal tp (experts are sharded over the TP ranks)
    transport: str = "auto"  # CPU collectives: runtime.cpu.shared_memory.TRANSPORTS (auto, shm, torch)


@dataclass
class OptimizerConfig:
    lr: float = 1.0e-3
    min_lr: float = 0.0
    weight_decay: float = 0.01
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_eps: float = 1.0e-8
    clip_grad: float = 1.0  # 0 disables clipping
    optimizer: str = "adam"  # adam (AdamW, decoupled weight decay) | sgd (momentum, L2 weight decay), as Megatron
    sgd_momentum: float = 0.9
    overlap_param_gather: bool = False  # distributed optimizer: each bucket's all-gather waits until its next forward
    use_distributed_optimizer: bool = False
    bucket_size: int = 4_000_000  # elements per data-parallel gradient bucket
    overlap_grad_reduce: bool = True
    # Megatron's --decoupled-lr/--decoupled-min-lr: the word embedding's and the output layer's
    # weights follow the same schedule between these instead of lr and min_lr (None: lr, min_lr)
    decoupled_lr: float | None = None
    decoupled_min_lr: float | None = None


@dataclass
class ScheduleConfig:
    lr_warmup_iters: int = 0
    lr_decay_style: str = "linear"
    lr_decay_iters: int | None = None  # None: train_iters
    lr_warmup_fraction: float | None = None  # warmup as a fraction of the decay steps (instead of lr_warmup_*)
    lr_wsd_decay_style: str = "exponential"  # WSD: the shape of the final decay (Megatron's default)
    lr_wsd_decay_iters: int | None = None  # WSD: the decay phase's length at the end of the decay steps
    # with --train-samples the schedule counts samples, as Megatron's (the *_iters above must stay unset)
    lr_warmup_samples: int = 0
    lr_decay_samples: int | None = None  # None: train_samples
    lr_wsd_decay_samples: int | None = None


@dataclass
class DataConfig:
    # a Megatron indexed dataset prefix (PREFIX.bin/.idx), or Megatron's --data-path list (a blend:
    # WEIGHT PREFIX ...); None: the embedded stdlib corpus (or --mock-data)
    data_path: str | list | None = None
    split: str = "969,30,1"  # train,valid[,test] weights over documents, as Megatron's --split
    # Megatron's per-split datasets (each a prefix or a blend list), instead of data_path and split
    train_data_path: str | list | None = None
    valid_data_path: str | list | None = None
    test_data_path: str | list | None = None
    mock_data: bool = False  # seeded random tokens, no files
    # the tokenizer (Megatron's --tokenizer-type and its files): it sizes the model's vocabulary
    tokenizer_type: str | None = None
    vocab_file: str | None = None
    merge_file: str | None = None
    tokenizer_model: str | None = None
    vocab_size: int | None = None  # Megatron's --vocab-size: NullTokenizer's and TikTokenizer's
    tiktoken_pattern: str | None = None
    tiktoken_num_special_tokens: int = 1000
    make_vocab_size_divisible_by: int = 128  # the model's vocabulary: the tokenizer's padded to a multiple of this x TP
    padded_vocab_size: int | None = None  # derived from the tokenizer by the launcher's checks
    eod_mask_loss: bool = False  # Megatron's: no loss where the input token is the end-of-document token
    # Megatron's packed documents, restarting after each end-of-document token: positions (the model
    # takes position_ids) and attention (document_ids); the model is compiled for them (Settings)
    reset_position_ids: bool = False
    reset_attention_mask: bool = False
    eod: int | None = None  # that token's id: the tokenizer's, or the data's (derived by the launcher's checks)


@dataclass
class CheckpointConfig:
    save: str | None = None
    load: str | None = None
    save_interval: int | None = None
    keep_last: int | None = None  # keep only the newest K checkpoints in `save` (None: all)
    allow_spec_change: bool = False  # load a checkpoint of another spec hash (names and shapes still checked)
    no_load_optim: bool = False  # --load the weights, iteration and data position, not the optimizer state
    finetune: bool = False  # --load the weights only: iteration 0, a fresh optimizer, the data from the start
    no_load_rng: bool = False  # Megatron's --no-load-rng: refused when a checkpoint is loaded (RNG states restored)
    # Megatron's --ckpt-format: "torch_dist" also writes each save as Megatron Core's torch_dist
    # iter_N/ in `save` (beside specc's step_N/, which resumes); None: specc's only
    ckpt_format: str | None = None


@dataclass
class LoggingConfig:
    run_dir: str = "runs/train"
    log_interval: int = 100
    progress: bool | None = None  # None: a progress bar when stderr is a terminal
    log_throughput: bool = False  # Megatron's --log-throughput; the log line always shows the throughput
    tensorboard_dir: str | None = None  # None: RUN_DIR/tensorboard
    # Megatron's TensorBoard switches: which of its scalars are written, and every how many iterations
    tensorboard_log_interval: int = 1
    log_timers_to_tensorboard: bool = False  # iteration-time (and throughput with log_throughput)
    log_loss_scale_to_tensorboard: bool = True
    log_validation_ppl_to_tensorboard: bool = False
    log_world_size_to_tensorboard: bool = False
    wandb_project: str | None = None  # Weights & Biases, imported only when a project is given
    wandb_exp_name: str | None = None
    peak_tflops: float | None = None  # per rank, for MFU; None: measured with a GEMM at the start


@dataclass
class LossScaleConfig:
    """fp16's loss scaling, Megatron's flags: a fixed --loss-scale, or dynamic (None) from
    --initial-loss-scale, halved on an overflow after `hysteresis` of them, never below
    --min-loss-scale, doubled after --loss-scale-window clean steps."""
    loss_scale: float | None = None
    initial_loss_scale: float = 2.0 ** 32
    min_loss_scale: float = 1.0
    loss_scale_window: int = 1000
    hysteresis: int = 2


@dataclass
class TrainConfig:
    spec: str
    overrides: dict = field(default_factory=dict)  # config name -> value, applied over the spec
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    schedule: ScheduleConfig = field(default_factory=ScheduleConfig)
    data: DataConfig = field(default_factory=DataConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    micro_batch_size: int = 1
    global_batch_size: int | None = None  # None: micro_batch_size * dp (no accumulation)
    # Megatron's --rampup-batch-size START INCREMENT SAMPLES: the global batch grows from START by
    # INCREMENT over SAMPLES consumed samples, up to global_batch_size (batch_size_at)
    rampup_batch_size: tuple | None = None
    # Megatron's --calculate-per-token-loss: the gradient of the loss summed over the global batch's
    # loss tokens (all micro-batches, all DP ranks) divided by their number, instead of the mean of
    # the micro-batches' per-token means
    calculate_per_token_loss: bool = False
    distributed_timeout_minutes: float | None = None  # the process groups' timeout (None: torch's, 30 minutes)
    train_iters: int | None = 100  # None with train_samples: derived, train_samples // global_batch_size
    train_samples: int | None = None
    exit_interval: int | None = None  # stop (saving with --save) after an iteration divisible by it
    exit_duration_in_mins: float | None = None  # stop (saving with --save) after the iteration that passes it
    eval_interval: int = 1000
    eval_iters: int = 10
    bf16: bool = False
    fp16: bool = False  # fp16 parameters and autocast with dynamic loss scaling (LossScaleConfig)
    loss_scale: LossScaleConfig = field(default_factory=lambda: LossScaleConfig())
    seed: int = 1234
    device: str = "auto"  # auto | cpu | cuda
    host_memory: str = "retain"  # on the CPU: HOST_MEMORY_MODES (retain: keep freed memory; release)
    torch_compile: str | None = None  # a torch.compile backend for each repeated layer (None: eager)
    # activation recompute, Megatron's flags as the compiler's settings: {} (none), or
    # recompute_granularity (full | selective), recompute_method, recompute_num_layers
    recompute: dict = field(default_factory=dict)
    # Megatron's habits that `resolve` accepts the way Megatron does (it warns and carries on):
    # each a line for the run's log
    notes: list = field(default_factory=list)

    @property
    def num_micro_batches(self) -> int:
        """Micro-batches per DP rank of a full global batch (after any ramp-up)."""
        return self.global_batch_size // (self.micro_batch_size * self.parallel.dp)

    def batch_size_at(self, consumed_samples: int) -> int:
        """The global batch of the iteration that starts after `consumed_samples`: Megatron's
        RampupBatchsizeNumMicroBatchesCalculator. START + INCREMENT x int(consumed / (SAMPLES /
        increments)) while consumed <= SAMPLES (increments = (global - START) / INCREMENT), the
        global batch after."""
        if self.rampup_batch_size is None:
            return self.global_batch_size
        start, increment, samples = self.rampup_batch_size
        if consumed_samples > samples or start == self.global_batch_size:
            return self.global_batch_size
        per_increment = samples / ((self.global_batch_size - start) // increment)
        return start + increment * int(consumed_samples / per_increment)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def _note(cfg: TrainConfig, line: str) -> None:
    if line not in cfg.notes:  # resolve runs again on every rank
        cfg.notes.append(line)


def resolve(cfg: TrainConfig, world_size: int) -> list[str]:
    """Derive the data-parallel size (and the default global batch) from the world size; return
    every broken rule as one line (empty: the configuration is consistent)."""
    errors = []
    par = cfg.parallel
    for name, flag, value in (("tp", "--tensor-model-parallel-size", par.tp),
                              ("cp", "--context-parallel-size", par.cp),
                              ("pp", "--pipeline-model-parallel-size", par.pp)):
        if value < 1:
            errors.append(f"{flag} must be at least 1, got {value}")
    if par.cp_comm_type not in CP_COMM_TYPES:
        errors.append(f"--cp-comm-type must be one of {', '.join(CP_COMM_TYPES)}, got {par.cp_comm_type!r}")
    elif par.cp_comm_type != "auto" and par.cp == 1:
        errors.append("--cp-comm-type has no effect without context parallelism (add --context-parallel-size N, "
                      "or drop --cp-comm-type)")
    if par.etp is not None and par.etp != par.tp:
        errors.append(f"--expert-tensor-parallel-size {par.etp} differs from --tensor-model-parallel-size {par.tp}: "
                      "experts are sharded over the tensor-parallel ranks (drop it, or give the TP size)")
    if par.pp_schedule is not None and par.pp == 1:
        errors.append("--pipeline-schedule has no effect without pipeline parallelism (add "
                      "--pipeline-model-parallel-size N, or drop it)")
    if par.sp and par.tp == 1:  # Megatron warns and turns it off
        par.sp = False
        _note(cfg, "--sequence-parallel at --tensor-model-parallel-size 1: sequence parallelism is off (it shards the "
                   "sequence over the tensor-parallel ranks), as Megatron turns it off")
    if world_size < 1:
        errors.append(f"world size must be at least 1, got {world_size}")
    model_parallel = max(par.tp, 1) * max(par.cp, 1) * max(par.pp, 1)
    if not errors and world_size % model_parallel != 0:
        errors.append(f"world size {world_size} is not divisible by TP*CP*PP = {par.tp}*{par.cp}*{par.pp} = "
                      f"{model_parallel} (world = TP*CP*DP*PP)")
    elif not errors:
        par.dp = world_size // model_parallel
        if par.ep < 1:
            errors.append(f"--expert-model-parallel-size must be at least 1, got {par.ep}")
        elif par.dp % par.ep:
            errors.append(f"--expert-model-parallel-size {par.ep} must divide the data-parallel size {par.dp} "
                          f"(expert parallelism is carved out of the data-parallel ranks: world = TP*CP*DP*PP)")
        elif par.ep > 1 and par.cp > 1:
            errors.append("--expert-model-parallel-size with --context-parallel-size is not supported yet")

    if cfg.micro_batch_size < 1:
        errors.append(f"--micro-batch-size must be at least 1, got {cfg.micro_batch_size}")
    elif not errors:
        per_step = cfg.micro_batch_size * par.dp
        if cfg.global_batch_size is None:
            cfg.global_batch_size = per_step
        if cfg.global_batch_size < 1:
            errors.append(f"--global-batch-size must be at least 1, got {cfg.global_batch_size}")
        elif cfg.global_batch_size % per_step != 0:
            errors.append(f"--global-batch-size {cfg.global_batch_size} is not divisible by micro batch * DP = "
                          f"{cfg.micro_batch_size}*{par.dp} = {per_step} (global batch = micro batch * DP * "
                          f"accumulation steps)")
        elif par.pp > 1 and cfg.num_micro_batches < par.pp and par.pp_schedule != "gpipe":
            errors.append(f"--global-batch-size {cfg.global_batch_size} gives {cfg.num_micro_batches} micro-batch(es) "
                          f"per step, fewer than the {par.pp} pipeline stages the 1F1B schedules keep in flight "
                          f"(use --global-batch-size {par.pp * per_step} or more)")
    errors += _rampup_rules(cfg, errors)
    errors += _length_rules(cfg, errors)
    for flag, value, least in (("--eval-interval", cfg.eval_interval, 1),
                               ("--eval-iters", cfg.eval_iters, 0), ("--log-interval", cfg.logging.log_interval, 1)):
        if value < least:
            errors.append(f"{flag} must be at least {least}, got {value}")
    if cfg.checkpoint.save_interval is not None and cfg.checkpoint.save_interval < 1:
        errors.append(f"--save-interval must be at least 1, got {cfg.checkpoint.save_interval}")
    if cfg.checkpoint.save_interval is not None and cfg.checkpoint.save is None:
        errors.append("--save-interval needs --save DIR")
    if cfg.checkpoint.keep_last is not None and cfg.checkpoint.keep_last < 1:
        errors.append(f"--keep-last must be at least 1, got {cfg.checkpoint.keep_last}")
    elif cfg.checkpoint.keep_last is not None and cfg.checkpoint.save is None:
        errors.append("--keep-last needs --save DIR")
    opt = cfg.optimizer
    numbers = (("--lr", opt.lr), ("--min-lr", opt.min_lr), ("--weight-decay", opt.weight_decay),
               ("--adam-beta1", opt.adam_beta1), ("--adam-beta2", opt.adam_beta2), ("--adam-eps", opt.adam_eps),
               ("--clip-grad", opt.clip_grad))
    infinite = [f"{flag} must be a finite number, got {value}" for flag, value in numbers if not math.isfinite(value)]
    errors += infinite
    if not infinite:  # the ranges, once every value is a number
        if opt.lr <= 0:
            errors.append(f"--lr must be positive, got {opt.lr}")
        elif opt.min_lr < 0 or opt.min_lr > opt.lr:
            errors.append(f"--min-lr must be between 0 and --lr ({opt.lr}), got {opt.min_lr}")
        if opt.clip_grad < 0:
            errors.append(f"--clip-grad must be at least 0 (0 disables clipping), got {opt.clip_grad}")
        if opt.weight_decay < 0:
            errors.append(f"--weight-decay must be at least 0, got {opt.weight_decay}")
        if not (0 <= opt.adam_beta1 < 1 and 0 <= opt.adam_beta2 < 1):
            errors.append(f"--adam-beta1/--adam-beta2 must be in [0, 1), got {opt.adam_beta1}, {opt.adam_beta2}")
        if opt.adam_eps <= 0:
            errors.append(f"--adam-eps must be positive, got {opt.adam_eps}")
    if opt.decoupled_lr is not None and not (math.isfinite(opt.decoupled_lr) and opt.decoupled_lr > 0):
        errors.append(f"--decoupled-lr must be a positive number, got {opt.decoupled_lr}")
    elif opt.decoupled_min_lr is not None and opt.decoupled_lr is None:  # Megatron reads it only with one
        _note(cfg, "--decoupled-min-lr without --decoupled-lr: no effect (every parameter follows --lr and --min-lr), "
                   "as Megatron ignores it")
    elif opt.decoupled_min_lr is not None and not (math.isfinite(opt.decoupled_min_lr)
                                                   and 0 <= opt.decoupled_min_lr <= opt.decoupled_lr):
        errors.append(f"--decoupled-min-lr must be between 0 and --decoupled-lr ({opt.decoupled_lr}), got "
                      f"{opt.decoupled_min_lr}")
    if opt.bucket_size < 1:
        errors.append(f"--ddp-bucket-size must be at least 1, got {opt.bucket_size}")
    if opt.optimizer not in OPTIMIZERS:
        errors.append(f"--optimizer must be one of {', '.join(OPTIMIZERS)}, got {opt.optimizer!r}")
    if not (math.isfinite(opt.sgd_momentum) and 0 <= opt.sgd_momentum < 1):
        errors.append(f"--sgd-momentum must be in [0, 1), got {opt.sgd_momentum}")
    if opt.overlap_param_gather and not opt.use_distributed_optimizer:
        errors.append("--overlap-param-gather needs --use-distributed-optimizer (it overlaps the distributed "
                      "optimizer's parameter all-gather with the next forward)")
    errors += _precision_rules(cfg)
    errors += _schedule_rules(cfg)
    try:
        split_weights(cfg.data.split)
    except ValueError as e:
        errors.append(f"--split {cfg.data.split}: {e}")
    if cfg.data.make_vocab_size_divisible_by < 1:
        errors.append(f"--make-vocab-size-divisible-by must be at least 1, got {cfg.data.make_vocab_size_divisible_by}")
    per_split = [cfg.data.train_data_path, cfg.data.valid_data_path, cfg.data.test_data_path]
    if cfg.data.mock_data and (cfg.data.data_path is not None or any(p is not None for p in per_split)):
        given = "--data-path" if cfg.data.data_path is not None else "--train-data-path/--valid-data-path/--test-data-path"
        errors.append(f"--mock-data and {given}: give one (mock data reads no files)")
    elif cfg.data.data_path is not None and any(p is not None for p in per_split):
        errors.append("--data-path and --train-data-path/--valid-data-path/--test-data-path: give one (--data-path "
                      "is split by --split; the others are a dataset per split)")
    elif cfg.data.train_data_path is None and any(p is not None for p in per_split):
        errors.append("--valid-data-path/--test-data-path need --train-data-path")
    if cfg.data.tokenizer_type is None:  # the files alone would be ignored: the model keeps the spec's vocabulary
        given = [flag for flag, value in (("--vocab-file", cfg.data.vocab_file), ("--merge-file", cfg.data.merge_file),
                                          ("--tokenizer-model", cfg.data.tokenizer_model)) if value is not None]
        if given:
            errors.append(f"{' and '.join(given)} without --tokenizer-type: say which tokenizer reads "
                          f"{'them' if len(given) > 1 else 'it'} (GPT2BPETokenizer for --vocab-file/--merge-file; "
                          "SentencePieceTokenizer, HuggingFaceTokenizer or TikTokenizer for --tokenizer-model)")
    if cfg.exit_interval is not None and cfg.exit_interval < 1:
        errors.append(f"--exit-interval must be at least 1, got {cfg.exit_interval}")
    minutes = cfg.exit_duration_in_mins
    if minutes is not None and not (math.isfinite(minutes) and minutes >= 0):
        errors.append(f"--exit-duration-in-mins must be a number of minutes, at least 0, got {minutes}")
    ckpt = cfg.checkpoint
    if ckpt.finetune and ckpt.load is None:
        errors.append("--finetune needs --load DIR")
    if ckpt.no_load_optim and ckpt.load is None:  # Megatron carries on: nothing is loaded
        _note(cfg, "--no-load-optim without --load: no effect (nothing is loaded)")
    if ckpt.no_load_rng and ckpt.load is None:
        _note(cfg, "--no-load-rng without --load: no effect (nothing is loaded)")
    if cfg.seed < 0:
        errors.append(f"--seed must be at least 0, got {cfg.seed}")
    if cfg.device not in ("auto", "cpu", "cuda"):
        errors.append(f"--device must be auto, cpu or cuda, got {cfg.device!r}")
    if cfg.host_memory not in HOST_MEMORY_MODES:
        errors.append(f"--host-memory must be {' or '.join(HOST_MEMORY_MODES)}, got {cfg.host_memory!r}")
    log = cfg.logging
    if log.tensorboard_log_interval < 1:
        errors.append(f"--tensorboard-log-interval must be at least 1, got {log.tensorboard_log_interval}")
    timeout = cfg.distributed_timeout_minutes
    if timeout is not None and not (math.isfinite(timeout) and timeout > 0):
        errors.append(f"--distributed-timeout-minutes must be a positive number of minutes, got {timeout}")
    if log.peak_tflops is not None and not log.peak_tflops > 0:
        errors.append(f"--peak-tflops must be positive, got {log.peak_tflops}")
    if log.wandb_exp_name is not None and log.wandb_project is None:
        errors.append("--wandb-exp-name needs --wandb-project NAME")
    if log.wandb_project is not None:
        import importlib.util

        if importlib.util.find_spec("wandb") is None:  # found, not imported: that waits for the run
            errors.append(f"--wandb-project {log.wandb_project}: the wandb package is not installed "
                          "(pip install wandb, or leave out --wandb-project)")
    return errors


def _rampup_rules(cfg: TrainConfig, errors: list) -> list:
    """--rampup-batch-size START INCREMENT SAMPLES: Megatron's asserts, all of them before the run
    (Megatron finds a batch size that micro batch x DP does not divide only when the ramp reaches it)."""
    if cfg.rampup_batch_size is None:
        return []
    try:
        start, increment, samples = (int(v) for v in cfg.rampup_batch_size)
    except (TypeError, ValueError):
        return [f"--rampup-batch-size takes three integers START INCREMENT SAMPLES, got {cfg.rampup_batch_size}"]
    cfg.rampup_batch_size = (start, increment, samples)
    out = []
    if start < 1 or increment < 1 or samples < 1:  # Megatron divides by the samples: 0 fails there
        out.append(f"--rampup-batch-size {start} {increment} {samples}: the start batch, the increment and the "
                   "ramp-up samples must be at least 1")
    if cfg.train_samples is None:  # Megatron: 'expected no batch-size rampup for iteration-based training'
        out.append("--rampup-batch-size needs --train-samples N (the ramp counts samples; iteration-based training "
                   "has none, as in Megatron)")
    if out or errors or not cfg.global_batch_size:
        return out
    per_step = cfg.micro_batch_size * cfg.parallel.dp
    if start > cfg.global_batch_size or (cfg.global_batch_size - start) % increment:
        out.append(f"--rampup-batch-size {start} {increment} {samples}: --global-batch-size {cfg.global_batch_size} "
                   f"must be the start batch plus a whole number of increments")
    elif start % per_step or (start < cfg.global_batch_size and increment % per_step):
        out.append(f"--rampup-batch-size {start} {increment} {samples}: every batch of the ramp must divide by micro "
                   f"batch * DP = {cfg.micro_batch_size}*{cfg.parallel.dp} = {per_step} (the start and the increment)")
    elif cfg.parallel.pp > 1 and start // per_step < cfg.parallel.pp and cfg.parallel.pp_schedule != "gpipe":
        out.append(f"--rampup-batch-size {start}: the first batches give {start // per_step} micro-batch(es) per step, "
                   f"fewer than the {cfg.parallel.pp} pipeline stages the 1F1B schedules keep in flight")
    return out


def rampup_iterations(cfg: TrainConfig) -> int:
    """Megatron's update_train_iters with a ramp: iterations until the ramp ends (or the samples
    run out: the last of them may overshoot), then whole global batches of what is left."""
    iterations = consumed = 0
    while consumed <= cfg.rampup_batch_size[2] and consumed <= cfg.train_samples:
        consumed += cfg.batch_size_at(consumed)
        iterations += 1
    if cfg.train_samples > consumed:
        iterations += (cfg.train_samples - consumed) // cfg.global_batch_size
    return iterations


def _length_rules(cfg: TrainConfig, errors: list) -> list:
    """--train-iters or --train-samples (iterations = samples // global batch, as Megatron)."""
    out = []
    if cfg.train_samples is not None:
        if cfg.train_samples < 1:
            out.append(f"--train-samples must be at least 1, got {cfg.train_samples}")
        elif not errors and cfg.global_batch_size:
            iters = cfg.train_samples // cfg.global_batch_size
            if cfg.rampup_batch_size is not None:
                iters = rampup_iterations(cfg)
            if iters < 1:
                out.append(f"--train-samples {cfg.train_samples} is less than one global batch "
                           f"({cfg.global_batch_size})")
            elif cfg.train_iters is not None and cfg.train_iters != iters:
                out.append("give one of --train-iters and --train-samples")
            else:
                cfg.train_iters = iters
    elif cfg.train_iters is None:
        out.append("give --train-iters N or --train-samples N")
    elif cfg.train_iters < 1:
        out.append(f"--train-iters must be at least 1, got {cfg.train_iters}")
    return out


def _precision_rules(cfg: TrainConfig) -> list:
    out = []
    if cfg.bf16 and cfg.fp16:
        out.append("give one of --bf16 and --fp16")
    ls = cfg.loss_scale
    for flag, value in (("--loss-scale", ls.loss_scale), ("--initial-loss-scale", ls.initial_loss_scale),
                        ("--min-loss-scale", ls.min_loss_scale)):
        if value is not None and not (math.isfinite(value) and value > 0):
            out.append(f"{flag} must be a positive number, got {value}")
    if ls.min_loss_scale > ls.initial_loss_scale:
        out.append(f"--min-loss-scale {ls.min_loss_scale} exceeds --initial-loss-scale {ls.initial_loss_scale}")
    for flag, value in (("--loss-scale-window", ls.loss_scale_window), ("--hysteresis", ls.hysteresis)):
        if value < 1:
            out.append(f"{flag} must be at least 1, got {value}")
    return out


def _schedule_rules(cfg: TrainConfig) -> list:
    out = []
    sched = cfg.schedule
    if sched.lr_decay_style not in DECAY_STYLES:
        out.append(f"--lr-decay-style must be one of {', '.join(DECAY_STYLES)}, got {sched.lr_decay_style!r}")
    if sched.lr_wsd_decay_style not in WSD_DECAY_STYLES:
        out.append(f"--lr-wsd-decay-style must be one of {', '.join(WSD_DECAY_STYLES)}, got "
                   f"{sched.lr_wsd_decay_style!r}")
    by_samples = cfg.train_samples is not None
    unit, other = ("samples", "iters") if by_samples else ("iters", "samples")
    wrong = [f"--lr-{name.replace('_', '-')}-{other}" for name in ("warmup", "decay", "wsd_decay")
             if getattr(sched, f"lr_{name}_{other}") not in (None, 0)]
    if wrong:
        out.append(f"{', '.join(wrong)} count {other}, but the run is given in "
                   f"{'samples (--train-samples)' if by_samples else 'iterations (--train-iters)'}: use "
                   + ", ".join(w.rsplit("-", 1)[0] + f"-{unit}" for w in wrong))
    for name in ("decay", "wsd_decay"):
        value = getattr(sched, f"lr_{name}_{unit}")
        if value is not None and value < 1:
            out.append(f"--lr-{name.replace('_', '-')}-{unit} must be at least 1, got {value}")
    warmup = getattr(sched, f"lr_warmup_{unit}")
    if warmup < 0:
        out.append(f"--lr-warmup-{unit} must be at least 0, got {warmup}")
    if sched.lr_warmup_fraction is not None:
        if not (math.isfinite(sched.lr_warmup_fraction) and 0 <= sched.lr_warmup_fraction <= 1):
            out.append(f"--lr-warmup-fraction must be in [0, 1], got {sched.lr_warmup_fraction}")
        if warmup:
            out.append(f"give one of --lr-warmup-fraction and --lr-warmup-{unit}")
    if sched.lr_decay_style == "WSD" and getattr(sched, f"lr_wsd_decay_{unit}") is None:
        out.append(f"--lr-decay-style WSD needs --lr-wsd-decay-{unit} N (the length of its final decay)")
    if out or cfg.train_iters is None or cfg.global_batch_size is None:
        return out
    warmup, decay, wsd = schedule_steps(cfg)
    if warmup > decay:
        out.append(f"the warmup ({warmup:g} {unit}) exceeds the decay {unit} ({decay})")
    elif sched.lr_decay_style == "WSD" and wsd > decay - warmup:
        out.append(f"--lr-wsd-decay-{unit} {wsd} exceeds the decay {unit} after warmup ({decay - warmup:g})")
    return out


def model_rules(cfg: TrainConfig, model_config: dict) -> list[str]:
    """Rules between the training settings and the compiled model's resolved config."""
    errors = []
    seq = model_config.get("seq_length")
    if not isinstance(seq, int) or seq < 1:
        errors.append("the spec has no positive integer config value 'seq_length' (the training sample length)")
    elif cfg.parallel.sp and cfg.parallel.tp > 1 and seq % cfg.parallel.tp != 0:
        errors.append(f"--seq-length {seq} is not divisible by the tensor-parallel size {cfg.parallel.tp} "
                      f"(sequence parallelism splits the sequence over TP ranks)")
    vocab = model_config.get("vocab_size")
    if not isinstance(vocab, int) or vocab < 1:
        errors.append("the spec has no positive integer config value 'vocab_size'")
    return errors


def split_weights(text: str) -> tuple[float, float, float]:
    """'969,30,1' -> normalized (train, valid, test) fractions; two values mean no test split."""
    parts = [p.strip() for p in str(text).replace("/", ",").split(",") if p.strip()]
    if len(parts) not in (2, 3):
        raise ValueError("expected 2 or 3 comma-separated weights (train,valid[,test]), e.g. 969,30,1")
    try:
        values = [float(p) for p in parts]
    except ValueError:
        raise ValueError("weights must be numbers, e.g. 969,30,1") from None
    if any(v < 0 or v != v or v == float("inf") for v in values) or sum(values) <= 0 or values[0] <= 0:
        raise ValueError("weights must be finite, non-negative, and the train weight positive")
    if sum(values) == float("inf"):  # each finite, the sum not: normalized they would all be 0
        raise ValueError("the weights add up to more than the largest float (inf); scale them down, only their "
                         "ratios count")
    values += [0.0] * (3 - len(values))
    total = sum(values)
    return tuple(v / total for v in values)


def schedule_steps(cfg: TrainConfig) -> tuple:
    """(warmup, decay, WSD decay) steps of the learning-rate schedule: iterations, or samples when
    the run is given in samples (--train-samples), as Megatron's OptimizerParamScheduler. A
    --lr-warmup-fraction is of the decay steps."""
    sched = cfg.schedule
    if cfg.train_samples is not None:
        decay = sched.lr_decay_samples if sched.lr_decay_samples is not None else cfg.train_samples
        warmup, wsd = sched.lr_warmup_samples, sched.lr_wsd_decay_samples
    else:
        decay = sched.lr_decay_iters if sched.lr_decay_iters is not None else cfg.train_iters
        warmup, wsd = sched.lr_warmup_iters, sched.lr_wsd_decay_iters
    if sched.lr_warmup_fraction is not None:
        warmup = sched.lr_warmup_fraction * decay
    return warmup, decay, wsd or 0


def lr_step(cfg: TrainConfig, iteration: int, consumed_samples: int | None = None) -> int:
    """Where iteration `iteration` (from 1) stands on the schedule: the iteration, or with
    --train-samples the samples consumed by the end of it (`consumed_samples`; without it, as
    many global batches as iterations: no ramp-up)."""
    if cfg.train_samples is None:
        return iteration
    return consumed_samples if consumed_samples is not None else iteration * cfg.global_batch_size
