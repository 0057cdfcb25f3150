"""What a run shows and keeps: Megatron-style log lines (with TFLOP/s per rank and MFU), a tqdm
progress bar on interactive terminals, metrics as JSONL, TensorBoard event files through
torch.utils.tensorboard's SummaryWriter, and Weights & Biases when a project is given (imported
only then). Only one rank (global rank 0) writes; the others get a Reporter that does nothing."""

from __future__ import annotations

import json
import math
import os
import sys
import time

from ..files import open_to_write, write_atomically

METRICS = "metrics.jsonl"
SAMPLES_DIR = "vs-samples"  # under the TensorBoard directory: the 'X vs samples' series
CONFIG = "config.json"


def format_config(config: dict, model_config: dict) -> str:
    """The effective configuration, one `name ... value` per line (Megatron's argument dump)."""
    rows = []

    def walk(prefix, value):
        if isinstance(value, dict) and value:
            for key in sorted(value):
                walk(f"{prefix}{key}.", value[key])
        else:
            rows.append((prefix.rstrip("."), value))

    walk("", config)
    rows += [(f"model.{key}", model_config[key]) for key in sorted(model_config)]
    width = max(len(name) for name, _ in rows)
    lines = ["------------------------ configuration ------------------------"]
    lines += [f"  {name} {'.' * (width + 3 - len(name))} {value}" for name, value in rows]
    lines.append("-------------------- end of configuration ---------------------")
    return "\n".join(lines)


class NullReporter:
    def start(self, *a, **k): pass
    def info(self, *a, **k): pass
    def train(self, *a, **k): pass
    def evaluation(self, *a, **k): pass
    def resume(self, *a, **k): pass
    def sync(self): pass
    def close(self): pass


class Reporter:
    """peak: a throughput.Peak (per rank) for MFU; None: TFLOP/s without MFU. tensorboard: the
    switches of runtime.train.config.LoggingConfig that pick Megatron's scalars
    (tensorboard_log_interval, log_timers_to_tensorboard, log_throughput, ...); world_size: the
    run's, for 'world-size'."""

    def __init__(self, run_dir: str, train_iters: int, log_interval: int, progress: bool | None = None,
                 stream=None, bar_stream=None, append: bool = False, tensorboard_dir: str | None = None,
                 peak=None, wandb_project: str | None = None, wandb_exp_name: str | None = None,
                 tensorboard=None, world_size: int = 1):
        self.run_dir = run_dir
        self.tb_options = tensorboard if tensorboard is not None else _DefaultTensorBoard()
        self.world_size = world_size
        self.train_iters, self.log_interval = train_iters, log_interval
        self.stream = stream or sys.stdout
        self.bar_stream = bar_stream or sys.stderr
        self.progress = self.bar_stream.isatty() if progress is None else progress
        self.peak = peak
        os.makedirs(run_dir, exist_ok=True)
        # A resumed run appends to its metrics; a new run starts them afresh.
        self._metrics = open_to_write(os.path.join(run_dir, METRICS), "a" if append else "w")
        self.tensorboard_dir = tensorboard_dir or os.path.join(run_dir, "tensorboard")
        self._tb_writer = None  # opened at the first scalar (a resumed run first says where to purge)
        self._purge_step = None
        # Megatron's 'X vs samples' series: steps are samples, so they purge on resume by samples,
        # in a directory of their own (a writer's purge hides every tag's events from its step on)
        self._samples_writer = None
        self._samples_purge_step = None
        self._wandb = None
        self._wandb_args = (wandb_project, wandb_exp_name) if wandb_project else None
        self._window: list = []
        self._bar = None

    @property
    def _tb(self):
        if self._tb_writer is None:
            self._tb_writer = _summary_writer(self.tensorboard_dir, self._purge_step)
        return self._tb_writer

    @property
    def _tb_samples(self):
        if self._samples_writer is None:
            self._samples_writer = _summary_writer(os.path.join(self.tensorboard_dir, SAMPLES_DIR),
                                                   self._samples_purge_step)
        return self._samples_writer

    # -- plain lines ----------------------------------------------------------------------------------

    def info(self, text: str) -> None:
        if self._bar is not None:  # tqdm clears the bar, prints the line, draws the bar again
            self._bar.write(text, file=self.stream)
            self.stream.flush()
        else:
            print(text, file=self.stream, flush=True)

    def start(self, config: dict, model_config: dict) -> None:
        with open_to_write(os.path.join(self.run_dir, CONFIG)) as f:
            json.dump({"train": config, "model": model_config}, f, indent=1, sort_keys=True, default=str)
            f.write("\n")
        self.info(format_config(config, model_config))
        if self._wandb_args:
            import wandb  # only here: a run without --wandb-project never imports it

            project, name = self._wandb_args
            self._wandb = wandb.init(project=project, name=name, dir=self.run_dir,
                                     config={"train": config, "model": model_config})

    # -- iterations ------------------------------------------------------------------------------------

    def train(self, *, iteration: int, consumed_samples: int, lr: float, loss: float, grad_norm: float,
              step_time: float, tokens: int, batch_size: int, memory_mb: float, skipped: bool,
              flops: int | None = None, aux_losses: dict | None = None, loss_scale: float = 1.0) -> None:
        """flops: this rank's FLOPs in the iteration (the compiled plan's count); loss_scale:
        fp16's (1.0 otherwise, as Megatron logs it)."""
        tflops = flops / step_time / 1e12 if flops and step_time > 0 else None
        mfu = self.peak.mfu(tflops) if tflops is not None and self.peak is not None else None
        record = {"kind": "train", "iteration": iteration, "consumed_samples": consumed_samples, "lr": lr,
                  "loss": loss, "grad_norm": grad_norm, "step_time_s": step_time,
                  "tokens_per_s": tokens / step_time if step_time > 0 else None, "tflops_per_rank": tflops,
                  "mfu": mfu, "memory_mb": memory_mb, "skipped": skipped, "loss_scale": loss_scale,
                  "batch_size": batch_size, "time": time.time()}
        opts = self.tb_options
        for name, value in sorted((aux_losses or {}).items()):  # MoE: logged beside the LM loss
            record[name] = value
            self._scalars(iteration, {name.replace("_", " "): value})
        self._metrics.write(metrics_line(record))
        megatron = {}  # Megatron's training_log scalars, each also against the samples consumed ('X vs samples')
        if iteration % opts.tensorboard_log_interval == 0:
            megatron = {"learning-rate": lr, "batch-size": batch_size, "lm loss": loss}
            if opts.log_loss_scale_to_tensorboard:
                megatron["loss-scale"] = loss_scale
            if opts.log_world_size_to_tensorboard:
                megatron["world-size"] = self.world_size
            if grad_norm is not None and math.isfinite(grad_norm):
                megatron["grad-norm"] = grad_norm
        # and specc's own, every iteration
        self._scalars(iteration, {**megatron, "throughput/tokens-per-second": record["tokens_per_s"],
                                  "throughput/tflops-per-gpu": tflops, "throughput/mfu": mfu,
                                  "step-time": step_time, "memory/max-mb": memory_mb},
                      samples=consumed_samples, vs_samples=megatron)
        self._window.append(record)
        if iteration % self.log_interval == 0 or iteration == self.train_iters:
            self._log_window(batch_size, tokens)
            self._metrics.flush()
            self.sync_tensorboard()
        if self.progress:
            self._advance_bar(iteration, loss)

    def _scalars(self, step: int, values: dict, samples: int | None = None, vs_samples=None) -> None:
        """values at `step`; with `samples`, those in `vs_samples` (all without it) also as 'TAG vs
        samples' at that many samples. W&B gets them in one call per step."""
        clean = {tag: float(v) for tag, v in values.items() if v is not None}
        for tag, value in clean.items():
            self._tb.add_scalar(tag, value, step)
            if samples is not None and (vs_samples is None or tag in vs_samples):
                self._tb_samples.add_scalar(f"{tag} vs samples", value, samples)
        if self._wandb is not None:
            self._wandb.log(clean, step=step)

    def _log_window(self, batch_size: int, tokens: int) -> None:
        w = self._window
        self._window = []
        last = w[-1]
        step = sum(r["step_time_s"] for r in w) / len(w)
        finite = [r["loss"] for r in w if math.isfinite(r["loss"])]
        loss = sum(finite) / len(finite) if finite else float("nan")
        skipped = sum(1 for r in w if r["skipped"])
        nan = sum(1 for r in w if not math.isfinite(r["loss"]))  # Megatron's: a loss that is inf or nan
        throughput = ""
        tflops = None
        if last["tflops_per_rank"] is not None:  # the window's mean step time: its mean TFLOP/s
            tflops = last["tflops_per_rank"] * last["step_time_s"] / step
            throughput = f"throughput per GPU (TFLOP/s/GPU): {tflops:.4g} | "
            if self.peak is not None:
                throughput += f"MFU: {100 * self.peak.mfu(tflops):.2f}% | "
        opts = self.tb_options
        if opts.log_timers_to_tensorboard:  # Megatron's, at its log line: the interval's mean
            timers = {"iteration-time": step}
            if opts.log_throughput and tflops is not None:
                timers["throughput"] = tflops
            self._scalars(last["iteration"], timers)
        self.info(
            f" [{time.strftime('%Y-%m-%d %H:%M:%S')}] iteration {last['iteration']:>8d}/{self.train_iters:>8d} | "
            f"consumed samples: {last['consumed_samples']:>12d} | elapsed time per iteration (ms): {step * 1000:.1f} | "
            f"{throughput}tokens per second: {tokens / step:.1f} | learning rate: {last['lr']:.6E} | "
            f"global batch size: {batch_size:>5d} | lm loss: {loss:.6E} | loss scale: {last['loss_scale']:.1f} | "
            f"grad norm: {last['grad_norm']:.3f} | max memory (MB): {last['memory_mb']:.1f} | "
            f"number of skipped iterations: {skipped:>3d} | number of nan iterations: {nan:>3d} |"
            + "".join(f" {k.replace('_', ' ')}: {last[k]:.6E} |" for k in ("load_balancing_loss", "z_loss") if k in last))

    def evaluation(self, *, iteration: int, loss: float, split: str = "validation",
                   consumed_samples: int | None = None) -> None:
        ppl = math.exp(min(loss, 20.0))
        self._metrics.write(metrics_line({"kind": "eval", "split": split, "iteration": iteration, "loss": loss,
                                          "ppl": ppl, "time": time.time()}))
        self._metrics.flush()
        # Megatron's evaluate_and_print_results: 'lm loss validation' (and its ppl with the flag)
        self._scalars(iteration, {f"lm loss {split}": loss}, samples=consumed_samples)
        if self.tb_options.log_validation_ppl_to_tensorboard:
            self._scalars(iteration, {f"lm loss {split} ppl": ppl}, samples=consumed_samples)
        self.sync_tensorboard()
        line = f" {split} loss at iteration {iteration} | lm loss value: {loss:.6E} | lm loss PPL: {ppl:.6E} | "
        bar = "-" * len(line)
        self.info(f"{bar}\n{line}\n{bar}")

    # -- durability ---------------------------------------------------------------------------------

    def sync(self) -> None:
        """Put every metric recorded so far on disk (flush and fsync). Called before each
        checkpoint is saved: whatever a later crash loses is after the checkpoint, and a resumed
        run computes it again."""
        self._metrics.flush()
        os.fsync(self._metrics.fileno())
        self.sync_tensorboard()

    def sync_tensorboard(self) -> None:
        for writer in (self._tb_writer, self._samples_writer):
            if writer is not None:
                writer.flush()

    def resume(self, iteration: int, consumed_samples: int | None = None) -> None:
        """A run that resumes after `iteration` (a checkpoint's; 0 when it starts over): drop the
        metrics recorded after it, which the run records again, and any line a killed run left
        half-written, so that every iteration appears exactly once. TensorBoard does the same
        for its events: a writer with purge_step hides the old events from that step on (the
        'vs samples' series' from the checkpoint's `consumed_samples` on)."""
        path = os.path.join(self.run_dir, METRICS)
        self._metrics.close()
        kept = []
        with open(path, encoding="utf-8", errors="replace") as f:
            for line in f:
                try:
                    record = json.loads(line)
                except ValueError:
                    continue
                it = record.get("iteration") if isinstance(record, dict) else None
                if isinstance(it, int) and it <= iteration:
                    kept.append(line.rstrip("\n") + "\n")
        write_atomically(path, "".join(kept), durable=True)
        self._metrics = open_to_write(path, "a")
        for writer in (self._tb_writer, self._samples_writer):
            if writer is not None:
                writer.close()
        self._tb_writer = self._samples_writer = None
        self._purge_step = iteration + 1
        self._samples_purge_step = consumed_samples + 1 if consumed_samples is not None else None

    # -- progress bar --------------------------------------------------------------------------------

    def _advance_bar(self, iteration: int, loss: float) -> None:
        if self._bar is None:
            from tqdm import tqdm

            # starts at the iteration before this one: a resumed run's bar shows the whole run
            self._bar = tqdm(total=self.train_iters, initial=iteration - 1, file=self.bar_stream, unit="it",
                             dynamic_ncols=True, leave=False, smoothing=0.1, mininterval=0, miniters=1)  # steps are slow: draw each
        self._bar.set_postfix_str(f"loss {loss:.4f}", refresh=False)
        self._bar.update(iteration - self._bar.n)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None
        self.sync()
        self._metrics.close()
        for writer in (self._tb_writer, self._samples_writer):
            if writer is not None:
                writer.close()
        if self._wandb is not None:
            self._wandb.finish()
            self._wandb = None


class _DefaultTensorBoard:
    """Megatron's defaults for its TensorBoard switches (LoggingConfig's)."""
    tensorboard_log_interval = 1
    log_timers_to_tensorboard = False
    log_throughput = False
    log_loss_scale_to_tensorboard = True
    log_validation_ppl_to_tensorboard = False
    log_world_size_to_tensorboard = False


def _summary_writer(directory: str, purge_step: int | None = None):
    from torch.utils.tensorboard import SummaryWriter  # needs the tensorboard package (a dependency)

    return SummaryWriter(log_dir=directory, purge_step=purge_step, flush_secs=30)


def metrics_line(record: dict) -> str:
    """One metrics.jsonl line, strict JSON: a NaN or infinite value (a diverged loss, an
    overflowing gradient norm) is written as null."""
    clean = {k: None if isinstance(v, float) and not math.isfinite(v) else v for k, v in record.items()}
    return json.dumps(clean, allow_nan=False) + "\n"
