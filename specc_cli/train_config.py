"""`specc train`'s command line as training's configuration (runtime.train.config's dataclasses):
what the launcher checks and what every rank launched by hand trains with."""

from __future__ import annotations

import os

from runtime.train.config import (
    CheckpointConfig,
    DataConfig,
    LoggingConfig,
    LossScaleConfig,
    OptimizerConfig,
    ParallelConfig,
    ScheduleConfig,
    TrainConfig,
)
from specc.settings import Settings
from specc_torch.train import Launch
from specc_torch.train_compile import spec_stem

from .args import MEGATRON_NOTES, overrides_from, recompute_from


def config_from_args(args) -> TrainConfig:
    overrides = {key: value for key, value, _ in overrides_from(args)}
    return TrainConfig(
        spec=args.spec,
        overrides=overrides,
        parallel=ParallelConfig(**{name: getattr(args, name) for name in Settings.names("parallel")},
                                pp_schedule=args.pp_schedule, transport=args.transport),
        optimizer=OptimizerConfig(lr=args.lr, min_lr=args.min_lr, weight_decay=args.weight_decay,
                                  adam_beta1=args.adam_beta1, adam_beta2=args.adam_beta2, adam_eps=args.adam_eps,
                                  clip_grad=args.clip_grad, use_distributed_optimizer=args.use_distributed_optimizer,
                                  bucket_size=args.ddp_bucket_size, overlap_grad_reduce=args.overlap_grad_reduce,
                                  optimizer=args.optimizer, sgd_momentum=args.sgd_momentum,
                                  overlap_param_gather=args.overlap_param_gather,
                                  decoupled_lr=args.decoupled_lr, decoupled_min_lr=args.decoupled_min_lr),
        schedule=ScheduleConfig(lr_warmup_iters=args.lr_warmup_iters, lr_decay_style=args.lr_decay_style,
                                lr_decay_iters=args.lr_decay_iters, lr_warmup_fraction=args.lr_warmup_fraction,
                                lr_wsd_decay_style=args.lr_wsd_decay_style, lr_wsd_decay_iters=args.lr_wsd_decay_iters,
                                lr_warmup_samples=args.lr_warmup_samples, lr_decay_samples=args.lr_decay_samples,
                                lr_wsd_decay_samples=args.lr_wsd_decay_samples),
        data=data_config_from_args(args),
        checkpoint=CheckpointConfig(save=args.save, load=args.load, save_interval=args.save_interval,
                                    keep_last=args.keep_last,
                                    allow_spec_change=args.allow_spec_change, no_load_optim=args.no_load_optim,
                                    finetune=args.finetune, no_load_rng=args.no_load_rng,
                                    ckpt_format=args.ckpt_format),
        logging=LoggingConfig(run_dir=args.run_dir or os.path.join("runs", spec_stem(args.spec)),
                              log_interval=args.log_interval, progress=args.progress,
                              log_throughput=args.log_throughput,
                              tensorboard_dir=args.tensorboard_dir, wandb_project=args.wandb_project,
                              tensorboard_log_interval=args.tensorboard_log_interval,
                              log_timers_to_tensorboard=args.log_timers_to_tensorboard,
                              log_loss_scale_to_tensorboard=args.log_loss_scale_to_tensorboard,
                              log_validation_ppl_to_tensorboard=args.log_validation_ppl_to_tensorboard,
                              log_world_size_to_tensorboard=args.log_world_size_to_tensorboard,
                              wandb_exp_name=args.wandb_exp_name, peak_tflops=args.peak_tflops),
        micro_batch_size=args.micro_batch_size, global_batch_size=args.global_batch_size,
        train_iters=args.train_iters if args.train_iters is not None or args.train_samples is not None else 100,
        train_samples=args.train_samples, exit_interval=args.exit_interval,
        rampup_batch_size=tuple(args.rampup_batch_size) if args.rampup_batch_size else None,
        calculate_per_token_loss=args.calculate_per_token_loss,
        distributed_timeout_minutes=args.distributed_timeout_minutes,
        exit_duration_in_mins=args.exit_duration_in_mins,
        fp16=args.fp16, loss_scale=LossScaleConfig(loss_scale=args.loss_scale,
                                                   initial_loss_scale=args.initial_loss_scale,
                                                   min_loss_scale=args.min_loss_scale,
                                                   loss_scale_window=args.loss_scale_window,
                                                   hysteresis=args.hysteresis),
        eval_interval=args.eval_interval, eval_iters=args.eval_iters,
        bf16=args.bf16, seed=args.seed, device=args.device, host_memory=args.host_memory,
        torch_compile=args.torch_compile_backend if args.torch_compile else None,
        recompute=recompute_from(args),
        notes=list(getattr(args, MEGATRON_NOTES, None) or []))  # Megatron's flags with no effect here


def data_config_from_args(args) -> DataConfig:
    def one(paths):  # a list of one prefix is that prefix
        return paths[0] if paths and len(paths) == 1 else paths

    return DataConfig(data_path=one(args.data_path), split=args.split, train_data_path=one(args.train_data_path),
                      valid_data_path=one(args.valid_data_path), test_data_path=one(args.test_data_path),
                      mock_data=args.mock_data, tokenizer_type=args.tokenizer_type, vocab_file=args.vocab_file,
                      merge_file=args.merge_file, tokenizer_model=args.tokenizer_model, vocab_size=args.vocab_size,
                      tiktoken_pattern=args.tiktoken_pattern,
                      tiktoken_num_special_tokens=args.tiktoken_num_special_tokens,
                      make_vocab_size_divisible_by=args.make_vocab_size_divisible_by,
                      eod_mask_loss=args.eod_mask_loss, reset_position_ids=args.reset_position_ids,
                      reset_attention_mask=args.reset_attention_mask)


def launch_from_args(args) -> Launch:
    return Launch(**{name: getattr(args, name) for name in Launch.__dataclass_fields__})
