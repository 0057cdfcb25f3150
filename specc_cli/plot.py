"""`specc plot RUN_DIR`: a training run's loss beside its throughput, learning rate, grad norm, TFLOP/s,
MFU and memory curves (each panel only when metrics.jsonl records it), as a PNG."""

from __future__ import annotations

import json
import math
import os
import sys


def read_metrics(run_dir: str):
    path = os.path.join(run_dir, "metrics.jsonl")
    if not os.path.isfile(path):
        raise ValueError(f"{run_dir}: no metrics.jsonl (is it the --run-dir of a `specc train` run?)")
    train, evals = [], []
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                raise ValueError(f"{path}:{number}: not a JSON line") from None
            except RecursionError:  # nested deeper than Python's parser recurses
                raise ValueError(f"{path}:{number}: not a metrics record (nested too deeply)") from None
            except ValueError as e:  # an integer of more digits than int() takes
                raise ValueError(f"{path}:{number}: not a metrics record ({str(e).split(':')[0]})") from None
            if not isinstance(record, dict):
                raise ValueError(f"{path}:{number}: not a JSON object")
            for key in ("loss", "ppl"):  # a NaN or infinite value is written as null
                if key in record and record[key] is None:
                    record[key] = float("nan")
            (train if record.get("kind") == "train" else evals if record.get("kind") == "eval" else []).append(record)
    if not train:
        raise ValueError(f"{path}: no training iterations recorded yet")
    # A resumed run appends: keep the last record of each iteration.
    train = sorted({r["iteration"]: r for r in train}.values(), key=lambda r: r["iteration"])
    evals = sorted({r["iteration"]: r for r in evals}.values(), key=lambda r: r["iteration"])
    return train, evals


def _smooth(values, window):
    out, acc = [], []
    for v in values:
        acc.append(v)
        if len(acc) > window:
            acc.pop(0)
        finite = [a for a in acc if a is not None and math.isfinite(a)]
        out.append(sum(finite) / len(finite) if finite else float("nan"))
    return out


# The panels beside the loss: (metrics.jsonl key, y label, colour, scale). A panel whose key no train
# record holds (or holds only as null) is left out.
PANELS = (
    ("tokens_per_s", "tokens / s (global)", "tab:green", 1.0),
    ("lr", "learning rate", "tab:purple", 1.0),
    ("grad_norm", "grad norm", "tab:red", 1.0),
    ("tflops_per_rank", "TFLOP/s per rank", "tab:brown", 1.0),
    ("mfu", "MFU (%)", "tab:pink", 100.0),
    ("memory_mb", "max memory (MB)", "tab:gray", 1.0),
)


def _finite(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def panels_of(train) -> list:
    """The metric panels this run has data for, in PANELS order (the loss panel is always drawn first)."""
    return [p for p in PANELS if any(_finite(r.get(p[0])) for r in train)]


def plot_run(run_dir: str, output: str) -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from specc.files import atomic_write, check_replaceable

    check_replaceable(output, "-o")  # a regular file or nothing, refused before the drawing
    train, evals = read_metrics(run_dir)
    its = [r["iteration"] for r in train]
    loss = [r["loss"] for r in train]
    window = max(1, len(train) // 50)
    panels = panels_of(train)
    cols = 2 if panels else 1
    rows = math.ceil((1 + len(panels)) / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(6 * cols, 3.2 * rows), sharex=True, squeeze=False)
    flat = [ax for row in axes for ax in row]
    ax1 = flat[0]
    ax1.plot(its, loss, color="tab:blue", alpha=0.3, linewidth=0.8, label="train loss")
    smooth = _smooth(loss, window)
    ax1.plot(its, smooth, color="tab:blue", linewidth=1.5, label=f"train loss (mean of {window})")
    if evals:
        ax1.plot([r["iteration"] for r in evals], [r["loss"] for r in evals], "o-", color="tab:orange",
                 label="validation loss")
    ax1.set_ylabel("loss (nats/token)")
    ax1.set_title(f"{os.path.basename(os.path.abspath(run_dir))}: train loss {loss[0]:.3f} -> {smooth[-1]:.3f} "
                  f"(last {window} mean) in {its[-1]} iterations", fontsize=9)
    ax1.grid(alpha=0.3)
    ax1.legend(fontsize=8)
    for ax, (key, label, colour, scale) in zip(flat[1:], panels):
        values = [r.get(key) * scale if _finite(r.get(key)) else float("nan") for r in train]
        ax.plot(its, values, color=colour, alpha=0.3, linewidth=0.8)
        ax.plot(its, _smooth(values, window), color=colour, linewidth=1.5)
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
    for ax in flat[1 + len(panels):]:
        ax.set_visible(False)
    for ax in flat[-cols:]:
        ax.set_xlabel("iteration")
        ax.xaxis.set_tick_params(labelbottom=True)
    fig.tight_layout()
    try:  # a temp file beside it, renamed over it: only ever over a regular file
        atomic_write(output, lambda f: fig.savefig(f, format="png", dpi=100, metadata={"Software": None}))
    finally:
        plt.close(fig)
    return output


def cmd_plot(args) -> int:
    output = args.output if args.output is not None else os.path.join(args.run_dir, "loss.png")
    try:
        if not os.path.isdir(args.run_dir):
            raise ValueError(f"{args.run_dir}: no such run directory")
        plot_run(args.run_dir, output)
    except (ValueError, KeyError, TypeError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except OSError as e:
        print(f"error: {output}: cannot write ({e.strerror or e})", file=sys.stderr)
        return 2
    print(f"wrote {output}", file=sys.stderr)
    return 0


def add_parsers(sub) -> None:
    c = sub.add_parser("plot", help="draw a training run's loss, throughput, learning rate, grad norm, TFLOP/s, MFU and memory "
                       "curves to a PNG (a panel only for the metrics the run recorded)")
    c.add_argument("run_dir", metavar="RUN_DIR", help="the --run-dir of a `specc train` run")
    c.add_argument("-o", "--output", default=None, metavar="PNG", help="default RUN_DIR/loss.png")
    c.set_defaults(func=cmd_plot)
