"""What a run shows and keeps: Megatron-style log lines, a progress bar with ETA on interactive
terminals, metrics as JSONL, and TensorBoard event files, all in the run directory. Only one
rank (global rank 0) writes; the others get a Reporter that does nothing."""

from __future__ import annotations

import json
import math
import os
import sys
import time

from .tensorboard import EventWriter

METRICS = "metrics.jsonl"
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
    def __init__(self, run_dir: str, train_iters: int, log_interval: int, progress: bool | None = None,
                 stream=None, bar_stream=None, append: bool = False):
        self.run_dir = run_dir
        self.train_iters, self.log_interval = train_iters, log_interval
        self.stream = stream or sys.stdout
        self.bar_stream = bar_stream or sys.stderr
        self.progress = self.bar_stream.isatty() if progress is None else progress
        os.makedirs(run_dir, exist_ok=True)
        # A resumed run appends to its metrics; a new run starts them afresh.
        self._metrics = open(os.path.join(run_dir, METRICS), "a" if append else "w", encoding="utf-8")
        self._tb = EventWriter(os.path.join(run_dir, "tensorboard"))
        self._window: list = []
        self._bar_shown = False
        self._start = time.monotonic()
        self._first_iteration = None

    # -- plain lines ----------------------------------------------------------------------------------

    def info(self, text: str) -> None:
        self._clear_bar()
        print(text, file=self.stream, flush=True)

    def start(self, config: dict, model_config: dict) -> None:
        with open(os.path.join(self.run_dir, CONFIG), "w", encoding="utf-8") as f:
            json.dump({"train": config, "model": model_config}, f, indent=1, sort_keys=True, default=str)
            f.write("\n")
        self.info(format_config(config, model_config))

    # -- iterations ------------------------------------------------------------------------------------

    def train(self, *, iteration: int, consumed_samples: int, lr: float, loss: float, grad_norm: float,
              step_time: float, tokens: int, batch_size: int, memory_mb: float, skipped: bool,
              aux_losses: dict | None = None) -> None:
        if self._first_iteration is None:
            self._first_iteration, self._first_time = iteration - 1, time.monotonic() - step_time
        record = {"kind": "train", "iteration": iteration, "consumed_samples": consumed_samples, "lr": lr,
                  "loss": loss, "grad_norm": grad_norm, "step_time_s": step_time,
                  "tokens_per_s": tokens / step_time if step_time > 0 else None, "memory_mb": memory_mb,
                  "skipped": skipped, "time": time.time()}
        for name, value in sorted((aux_losses or {}).items()):  # MoE: logged beside the LM loss
            record[name] = value
            self._tb.scalars(iteration, {name.replace("_", " "): value})
        self._metrics.write(metrics_line(record))
        self._tb.scalars(iteration, {"lm loss": loss, "learning-rate": lr, "grad-norm": grad_norm,
                                     "throughput/tokens-per-second": record["tokens_per_s"],
                                     "step-time": step_time, "memory/max-mb": memory_mb})
        self._window.append(record)
        if iteration % self.log_interval == 0 or iteration == self.train_iters:
            self._log_window(batch_size, tokens)
            self._metrics.flush()
            self._tb.flush()
        if self.progress:
            self._draw_bar(iteration, loss)

    def _log_window(self, batch_size: int, tokens: int) -> None:
        w = self._window
        self._window = []
        last = w[-1]
        step = sum(r["step_time_s"] for r in w) / len(w)
        finite = [r["loss"] for r in w if math.isfinite(r["loss"])]
        loss = sum(finite) / len(finite) if finite else float("nan")
        skipped = sum(1 for r in w if r["skipped"])
        self.info(
            f" [{time.strftime('%Y-%m-%d %H:%M:%S')}] iteration {last['iteration']:>8d}/{self.train_iters:>8d} | "
            f"consumed samples: {last['consumed_samples']:>12d} | elapsed time per iteration (ms): {step * 1000:.1f} | "
            f"tokens per second: {tokens / step:.1f} | learning rate: {last['lr']:.6E} | "
            f"global batch size: {batch_size:>5d} | lm loss: {loss:.6E} | grad norm: {last['grad_norm']:.3f} | "
            f"max memory (MB): {last['memory_mb']:.1f} | number of skipped iterations: {skipped:>3d} |"
            + "".join(f" {k.replace('_', ' ')}: {last[k]:.6E} |" for k in ("load_balancing_loss", "z_loss") if k in last))

    def evaluation(self, *, iteration: int, loss: float, split: str = "validation") -> None:
        ppl = math.exp(min(loss, 20.0))
        self._metrics.write(metrics_line({"kind": "eval", "split": split, "iteration": iteration, "loss": loss,
                                          "ppl": ppl, "time": time.time()}))
        self._metrics.flush()
        self._tb.scalars(iteration, {f"{split} loss": loss, f"{split} ppl": ppl})
        self._tb.flush()
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
        self._tb.flush()

    def resume(self, iteration: int) -> None:
        """A run that resumes after `iteration` (a checkpoint's; 0 when it starts over): drop the
        metrics recorded after it, which the run records again, and any line a killed run left
        half-written, so that every iteration appears exactly once."""
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
        tmp = path + ".tmp"
        with open(tmp, "w", encoding="utf-8") as f:
            f.writelines(kept)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        self._metrics = open(path, "a", encoding="utf-8")

    # -- progress bar --------------------------------------------------------------------------------

    def _draw_bar(self, iteration: int, loss: float) -> None:
        done = iteration - self._first_iteration
        elapsed = time.monotonic() - self._first_time
        left = self.train_iters - iteration
        eta = elapsed / done * left if done > 0 else 0.0
        width = 30
        filled = int(width * iteration / self.train_iters)
        text = (f"\r[{'#' * filled}{'.' * (width - filled)}] {iteration}/{self.train_iters} "
                f"{100 * iteration / self.train_iters:3.0f}% ETA {_clock(eta)} loss {loss:.4f}")
        self.bar_stream.write(text)
        self.bar_stream.flush()
        self._bar_shown = True

    def _clear_bar(self) -> None:
        if self._bar_shown:
            self.bar_stream.write("\r\033[K")
            self.bar_stream.flush()
            self._bar_shown = False

    def close(self) -> None:
        self._clear_bar()
        self.sync()
        self._metrics.close()
        self._tb.close()


def metrics_line(record: dict) -> str:
    """One metrics.jsonl line, strict JSON: a NaN or infinite value (a diverged loss, an
    overflowing gradient norm) is written as null."""
    clean = {k: None if isinstance(v, float) and not math.isfinite(v) else v for k, v in record.items()}
    return json.dumps(clean, allow_nan=False) + "\n"


def _clock(seconds: float) -> str:
    seconds = int(round(seconds))
    return f"{seconds // 3600}:{seconds % 3600 // 60:02d}:{seconds % 60:02d}"
