"""`specc plot RUN_DIR`: loss and throughput curves of a training run, as a PNG."""

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


def plot_run(run_dir: str, output: str) -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    train, evals = read_metrics(run_dir)
    its = [r["iteration"] for r in train]
    loss = [r["loss"] for r in train]
    tps = [r.get("tokens_per_s") for r in train]
    window = max(1, len(train) // 50)
    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(8, 7), sharex=True)
    ax1.plot(its, loss, color="tab:blue", alpha=0.3, linewidth=0.8, label="train loss")
    smooth = _smooth(loss, window)
    ax1.plot(its, smooth, color="tab:blue", linewidth=1.5, label=f"train loss (mean of {window})")
    if evals:
        ax1.plot([r["iteration"] for r in evals], [r["loss"] for r in evals], "o-", color="tab:orange",
                 label="validation loss")
    ax1.set_ylabel("loss (nats/token)")
    ax1.set_title(f"{os.path.basename(os.path.abspath(run_dir))}: train loss {loss[0]:.3f} -> {smooth[-1]:.3f} "
                  f"(last {window} mean) in {its[-1]} iterations")
    ax1.grid(alpha=0.3)
    ax1.legend()
    ax2.plot(its, [t if t is not None else float("nan") for t in tps], color="tab:green", alpha=0.3, linewidth=0.8)
    ax2.plot(its, _smooth(tps, window), color="tab:green", linewidth=1.5)
    ax2.set_ylabel("tokens / s (global)")
    ax2.set_xlabel("iteration")
    ax2.grid(alpha=0.3)
    fig.tight_layout()
    tmp = output + ".tmp.png"
    fig.savefig(tmp, dpi=100)
    plt.close(fig)
    os.replace(tmp, output)
    return output


def cmd_plot(args) -> int:
    output = args.output or os.path.join(args.run_dir, "loss.png")
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
    c = sub.add_parser("plot", help="draw a training run's loss and throughput curves to a PNG")
    c.add_argument("run_dir", metavar="RUN_DIR", help="the --run-dir of a `specc train` run")
    c.add_argument("-o", "--output", default=None, metavar="PNG", help="default RUN_DIR/loss.png")
    c.set_defaults(func=cmd_plot)
