"""A training run's configuration and model, shared by the launcher, every rank and the checks:
TrainConfig from its JSON form, the spec compiled at the run's settings (compile_model,
compile_run) with the files a run keeps of it, and the error lines every broken rule prints."""

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

from .api import compile_source


class ConfigError(Exception):
    """Broken rules, one line each."""

    def __init__(self, lines: list):
        super().__init__("\n".join(lines))
        self.lines = lines


# -- configuration from the command line -----------------------------------------------------------

def config_from_dict(d: dict) -> TrainConfig:
    d = dict(d)
    sections = {"parallel": ParallelConfig, "optimizer": OptimizerConfig, "schedule": ScheduleConfig,
                "data": DataConfig, "checkpoint": CheckpointConfig, "logging": LoggingConfig,
                "loss_scale": LossScaleConfig}
    for name, cls in sections.items():
        d[name] = cls(**d[name])
    return TrainConfig(**d)


def spec_stem(path: str) -> str:
    base = os.path.basename(os.path.normpath(path))
    return base.rsplit(".", 1)[0] if base.endswith((".yaml", ".yml")) else base


# -- the model: the spec compiled at the configured settings ------------------------------------------

def compile_model(cfg: TrainConfig):
    """(generated source, spec) for the configured spec at the configured parallel settings: what
    runtime.train.setup_model_and_optimizer builds the model from."""
    source, spec, _ = _compile(cfg)
    return source, spec


def _compile(cfg: TrainConfig):
    overrides = dict(cfg.overrides)
    if cfg.data.padded_vocab_size is not None and "vocab_size" not in overrides:
        overrides["vocab_size"] = cfg.data.padded_vocab_size  # the tokenizer's, padded (tokenizer_rules)
    return compile_source(cfg.spec, compile_settings(cfg), overrides)


def compile_settings(cfg: TrainConfig) -> Settings:
    """The compiler's settings of a training configuration: the runtime's ParallelConfig holds
    every parallel setting under the same name (tests/specc_cli/test_settings_table.py checks it)."""
    return Settings(**{name: getattr(cfg.parallel, name) for name in Settings.names("parallel")},
                    micro_batch_size=cfg.micro_batch_size, dtype="bf16" if cfg.bf16 else "fp16" if cfg.fp16 else "fp32",
                    reset_position_ids=cfg.data.reset_position_ids, reset_attention_mask=cfg.data.reset_attention_mask,
                    **cfg.recompute)


RUN_FILES = ("model.py", "plan.txt", "plan.json")


def compile_run(cfg: TrainConfig):
    """(generated source, spec, plan) for the configured spec and settings: the model and the
    plan that trains, as compile_model, plus the plan (specc.plan.Plan) of the same graph."""
    from specc.plan import build_plan

    source, spec, graph = _compile(cfg)
    return source, spec, build_plan(graph)


def write_run_files(run_dir: str, source: str, plan) -> str:
    """RUN_DIR/model.py, plan.txt and plan.json: exactly what trains (each written atomically; a
    resumed run writes what it trains now). Returns model.py's path."""
    from specc.files import atomic_write_text
    from specc.plan import plan_json, plan_text

    os.makedirs(run_dir, exist_ok=True)
    for name, text in zip(RUN_FILES, (source, plan_text(plan), plan_json(plan))):
        atomic_write_text(os.path.join(run_dir, name), text)
    return os.path.join(run_dir, RUN_FILES[0])


def error_lines(e: Exception) -> list:
    from specc.errors import SpecError

    if isinstance(e, ConfigError):
        return [f"error: {line}" for line in e.lines]
    if isinstance(e, SpecError):
        return [e.format()]
    return [f"error: {e}"]
