"""The prepared GPU check: one script that a session lent a CUDA machine runs first, within 10
minutes on one GPU (`make gpu-check`), and whose results go into docs/benchmarks.md.

    python bench/gpu_check.py [--device cuda] [--budget-s 540] [--no-write] [--json out.json]

Checks, in order (each is skipped with its reason when the machine cannot run it):

  cuda_vs_cpu   the tiny GPT and Llama at TP=1, fp32 (TF32 off): loss and every gradient on the
                device against the same model on the CPU, within 1e-4 of the largest value
  backends      TransformerEngine (`--backend te`) and flash-attn against the native path on the
                device, bf16 autocast: the same loss within bf16 tolerance (compile, run, compare)
  nccl_verify   `specc train` of the tiny GPT at TP=2 with SP on 2 GPUs over NCCL against the same
                3 steps at TP=1: the same losses (1e-4 relative), when there are at least 2 GPUs
  bench_124m    a bf16 training step of the 124M GPT (specs/gpt.yaml, seq 1024): step time,
                tokens/s, MFU against a measured bf16 GEMM peak, and peak memory against the plan

The logic that does not need a GPU (which checks run, comparisons, MFU, the budget, the report and
its place in docs/benchmarks.md) is tested on the CPU: tests/bench/test_gpu_check.py runs the
whole script with `--device cpu` at tiny sizes.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import importlib.util
import json
import os
import subprocess
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from benchdoc import replace_section  # noqa: E402

SECTION = "## GPU check"
TINY_SPECS = ("specs/gpt-tiny.yaml", "specs/llama-tiny.yaml")
BENCH_SPEC = "specs/gpt.yaml"


@dataclasses.dataclass
class Machine:
    device: str  # "cuda" or "cpu"
    gpus: int
    name: str
    te: bool
    flash: bool

    @classmethod
    def detect(cls, device: str) -> "Machine":
        gpus = torch.cuda.device_count() if device == "cuda" and torch.cuda.is_available() else 0
        name = torch.cuda.get_device_name(0) if gpus else "CPU"
        return cls(device, gpus, name, _installed("transformer_engine"), _installed("flash_attn"))


def _installed(package: str) -> bool:
    return importlib.util.find_spec(package) is not None


@dataclasses.dataclass
class Result:
    check: str
    status: str  # pass | fail | skipped
    detail: str
    seconds: float = 0.0
    numbers: dict = dataclasses.field(default_factory=dict)


def plan_checks(machine: Machine) -> list:
    """(check name, reason it is skipped or None) in running order."""
    gpu = machine.device == "cuda"
    if gpu and not machine.gpus:
        raise SystemExit("error: gpu_check: --device cuda but torch sees no CUDA device (use --device cpu to "
                         "exercise the script's logic)")
    backends = [b for b, ok in (("te", machine.te), ("flash", machine.flash)) if ok]
    return [
        ("cuda_vs_cpu", None),
        ("backends", None if gpu and backends else
         "needs CUDA" if not gpu else "neither transformer_engine nor flash_attn is installed"),
        ("nccl_verify", None if machine.gpus >= 2 else f"needs 2 GPUs, this machine has {machine.gpus}"),
        ("bench_124m", None),
    ]


def compare(ref: torch.Tensor, got: torch.Tensor, tol: float) -> tuple:
    """(ok, largest difference, largest reference value): a tensor passes when its largest
    difference is within tol of its largest value (rounding is relative to the scale summed)."""
    ref, got = ref.detach().double().cpu(), got.detach().double().cpu()
    scale = ref.abs().max().item() if ref.numel() else 0.0
    diff = (ref - got).abs().max().item() if ref.numel() else 0.0
    return diff <= tol * max(scale, 1e-30) or diff == 0.0, diff, scale


def _batch(vocab: int, seq: int, batch: int, seed: int, device) -> tuple:
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, vocab, (batch, seq + 1), generator=g)
    return tokens[:, :-1].contiguous().to(device), tokens[:, 1:].contiguous().to(device)


def _loss_and_grads(model, batch) -> tuple:
    model.zero_grad(set_to_none=True)
    loss = model(*batch).float().mean()
    loss.backward()
    return loss.detach(), {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def check_device_vs_cpu(device: str, specs=TINY_SPECS, seed: int = 1234) -> Result:
    """The same model (same seed) on the CPU and on `device`: loss and every gradient."""
    import specc_torch

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    worst, lines = 0.0, []
    for spec in specs:
        cpu_model = specc_torch.build_model(os.path.join(ROOT, spec), seed=seed, backend="native")
        dev_model = specc_torch.build_model(os.path.join(ROOT, spec), seed=seed, backend="native").to(device)
        vocab, seq = _vocab_and_seq(spec)
        ref_loss, ref_grads = _loss_and_grads(cpu_model, _batch(vocab, seq, 2, seed, "cpu"))
        loss, grads = _loss_and_grads(dev_model, _batch(vocab, seq, 2, seed, device))
        bad = [] if compare(ref_loss, loss, 1e-5)[0] else ["loss"]
        for name, g in ref_grads.items():
            ok, diff, scale = compare(g, grads[name], 1e-4)
            worst = max(worst, diff / max(scale, 1e-30))
            if not ok:
                bad.append(name)
        lines.append(f"{os.path.basename(spec)}: loss {ref_loss.item():.6f} vs {loss.item():.6f}, "
                     f"{len(ref_grads)} gradients" + (f", MISMATCH in {', '.join(bad[:3])}" if bad else ""))
        if bad:
            return Result("cuda_vs_cpu", "fail", "; ".join(lines), numbers={"worst_relative": worst})
    return Result("cuda_vs_cpu", "pass", "; ".join(lines) + f"; worst gradient difference {worst:.1e} of its max",
                  numbers={"worst_relative": worst})


def _vocab_and_seq(spec: str) -> tuple:
    from specc.frontend.load import load_spec

    config = load_spec(os.path.join(ROOT, spec)).config
    return int(config["vocab_size"]), int(config["seq_length"])


def check_backends(device: str, machine: Machine, seed: int = 1234) -> Result:
    """Each installed fused backend against native on the device, bf16 autocast: same loss."""
    import specc_torch

    spec = os.path.join(ROOT, TINY_SPECS[0])
    vocab, seq = _vocab_and_seq(TINY_SPECS[0])
    batch = _batch(vocab, seq, 2, seed, device)
    losses = {}
    for backend in ["native"] + [b for b, ok in (("te", machine.te), ("flash", machine.flash)) if ok]:
        model = specc_torch.build_model(spec, seed=seed, backend=backend, dtype="bf16").to(device)
        with torch.autocast(device_type=device, dtype=torch.bfloat16):
            losses[backend] = model(*batch).float().mean().item()
    # bf16 keeps 8 bits of mantissa: relative error ~ 2^-8 per rounding; a few percent over a model
    bad = [b for b, v in losses.items() if abs(v - losses["native"]) > 2e-2 * abs(losses["native"])]
    detail = ", ".join(f"{b} {v:.4f}" for b, v in losses.items())
    return Result("backends", "fail" if bad else "pass", f"loss {detail}", numbers=losses)


def _train_losses(run_dir: str, device: str, nproc: int, extra: list, timeout_s: float) -> list:
    """Per-iteration training losses of a short `specc train` on mock data (metrics.jsonl)."""
    cmd = [sys.executable, "-m", "specc_cli", "train", os.path.join(ROOT, TINY_SPECS[0]), "--nproc-per-node", str(nproc),
           "--mock-data", "--micro-batch-size", "2", "--global-batch-size", "4", "--train-iters", "3", "--lr", "1e-3",
           "--log-interval", "1", "--eval-iters", "0", "--device", device, "--run-dir", run_dir, *extra]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, cwd=ROOT)
    if out.returncode != 0:
        tail = [ln for ln in (out.stdout + out.stderr).strip().splitlines() if ln.strip()][-1:] or [""]
        raise RuntimeError(f"`specc train ... {' '.join(extra)}` failed: {tail[0]}")
    with open(os.path.join(run_dir, "metrics.jsonl"), encoding="utf-8") as f:
        records = [json.loads(line) for line in f if line.strip()]
    return [r["loss"] for r in records if r.get("kind") == "train"]


def check_multi_rank(device: str, nproc: int, timeout_s: float) -> Result:
    """The tiny GPT trained 3 steps at TP=2 with SP on `nproc` ranks (NCCL on CUDA) against the same
    run at TP=1 on one rank: the same losses (the data, weights and steps do not depend on TP)."""
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        start = time.perf_counter()
        ref = _train_losses(os.path.join(tmp, "tp1"), device, 1, [], timeout_s)
        got = _train_losses(os.path.join(tmp, "tp2"), device, nproc,
                            ["--tensor-model-parallel-size", "2", "--sequence-parallel"],
                            max(timeout_s - (time.perf_counter() - start), 10))
    if len(ref) != 3 or len(got) != 3:
        return Result("nccl_verify", "fail", f"expected 3 logged steps, got {len(ref)} and {len(got)}")
    worst = max(abs(a - b) / abs(a) for a, b in zip(ref, got))
    detail = (f"specc train gpt-tiny 3 steps, TP=2+SP on {nproc} ranks vs TP=1: losses "
              + ", ".join(f"{b:.5f}/{a:.5f}" for a, b in zip(ref, got)) + f", worst relative {worst:.1e}")
    return Result("nccl_verify", "pass" if worst <= 1e-4 else "fail", detail, numbers={"worst_relative": worst})


def gemm_peak_tflops(device: str, dtype: torch.dtype, n: int, repeats: int = 10) -> float:
    """Achieved TFLOP/s of an n x n x n matrix product: the peak MFU is measured against."""
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    for _ in range(2):
        a @ b
    _sync(device)
    start = time.perf_counter()
    for _ in range(repeats):
        a @ b
    _sync(device)
    return 2 * n ** 3 * repeats / (time.perf_counter() - start) / 1e12


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def mfu(flops: float, seconds: float, peak_tflops: float) -> float:
    return flops / seconds / (peak_tflops * 1e12) if seconds > 0 and peak_tflops > 0 else 0.0


def check_bench(device: str, spec: str, micro_batch: int, steps: int, gemm_n: int, overrides: dict) -> Result:
    """A bf16 training step (forward, backward, gradient finalization, distributed Adam) of the
    compiled model through the runtime's own setup_model_and_optimizer and train_step."""
    from runtime.parallel_state import ProcessGroups
    from runtime.train.config import ParallelConfig, TrainConfig
    from runtime.train.training import setup_model_and_optimizer, train_step
    from specc.plan.build import build_plan
    from specc.plan.render import plan_dict
    from specc.settings import Settings
    from specc_torch.api import compile_source
    from specc_torch.train_compile import compile_model

    bf16 = device == "cuda"
    cfg = TrainConfig(spec=os.path.join(ROOT, spec), overrides=overrides, parallel=ParallelConfig(),
                      micro_batch_size=micro_batch, global_batch_size=micro_batch, bf16=bf16, device=device)
    pg = ProcessGroups.single()
    setup = setup_model_and_optimizer(cfg, pg, torch.device(device), compiled=compile_model(cfg))
    config = setup.spec.config
    vocab, seq = int(config["vocab_size"]), int(config["seq_length"])
    settings = Settings(micro_batch_size=micro_batch, dtype="bf16" if bf16 else "fp32")
    _, _, graph = compile_source(cfg.spec, settings, overrides)
    totals = plan_dict(build_plan(graph))["totals"]
    planned = totals["parameter_bytes"] + totals["gradient_bytes"] + totals["optimizer_bytes"] + totals["activation_bytes"]
    batches = [[_batch(vocab, seq, micro_batch, 1234 + i, device)] for i in range(3)]
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    times, loss = [], None
    for i in range(steps + 2):
        _sync(device)
        start = time.perf_counter()
        loss = train_step(setup, batches[i % 3], 1e-4, pg, bf16).loss
        _sync(device)
        if i >= 2:  # two warm-up steps
            times.append(time.perf_counter() - start)
    step = sorted(times)[len(times) // 2]
    peak = gemm_peak_tflops(device, torch.bfloat16 if bf16 else torch.float32, gemm_n)
    flops = float(totals["flops_per_step"])  # the compiler's count: every op's matmul FLOPs, forward and backward
    measured = torch.cuda.max_memory_allocated() if device == "cuda" else None
    numbers = {"step_ms": step * 1e3, "tokens_per_s": micro_batch * seq / step, "tflops": flops / step / 1e12,
               "gemm_peak_tflops": peak, "mfu": mfu(flops, step, peak), "plan_bytes": planned,
               "measured_bytes": measured, "loss": loss}
    memory = (f"peak memory {measured / 2**30:.2f} GiB vs plan {planned / 2**30:.2f} GiB" if measured is not None
              else f"plan {planned / 2**30:.3f} GiB (peak memory is measured on CUDA only)")
    detail = (f"{os.path.basename(spec)} micro-batch {micro_batch} seq {seq}, {'bf16' if bf16 else 'fp32'}: "
              f"step {step * 1e3:.1f} ms, {numbers['tokens_per_s']:.0f} tokens/s, {numbers['tflops']:.2f} TFLOP/s, "
              f"MFU {numbers['mfu']:.1%} of a measured {peak:.1f} TFLOP/s GEMM; {memory}; loss {loss:.4f}")
    return Result("bench_124m", "pass", detail, numbers=numbers)


def run_checks(machine: Machine, args) -> list:
    start, results = time.perf_counter(), []
    for name, skip in plan_checks(machine):
        left = args.budget_s - (time.perf_counter() - start)
        if skip is None and left < 30:
            skip = f"the {args.budget_s:.0f} s budget is spent"
        if skip is not None:
            results.append(Result(name, "skipped", skip))
            print(f"gpu_check: {name}: skipped ({skip})", flush=True)
            continue
        t0 = time.perf_counter()
        print(f"gpu_check: {name} ...", flush=True)
        try:
            if name == "cuda_vs_cpu":
                r = check_device_vs_cpu(machine.device)
            elif name == "backends":
                r = check_backends(machine.device, machine)
            elif name == "nccl_verify":
                r = check_multi_rank(machine.device, 2, timeout_s=max(left - 10, 10))
            else:
                r = check_bench(machine.device, args.bench_spec, args.micro_batch, args.steps, args.gemm_n,
                                dict(args.set))
        except Exception as e:  # one check failing must not hide the others' results
            r = Result(name, "fail", f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}")
        r.seconds = time.perf_counter() - t0
        print(f"gpu_check: {name}: {r.status}: {r.detail}", flush=True)
        results.append(r)
    return results


def render(machine: Machine, results: list, elapsed: float, date: str) -> str:
    lines = [SECTION, "",
             f"Run by `make gpu-check` (`python bench/gpu_check.py`) on {date}: {machine.name}, "
             f"{machine.gpus} GPU(s), torch {torch.__version__}, transformer_engine "
             f"{'installed' if machine.te else 'not installed'}, flash_attn {'installed' if machine.flash else 'not installed'}; "
             f"the run took {elapsed:.0f} s.", "",
             "| check | result | seconds | detail |", "|---|---|---|---|"]
    for r in results:
        lines.append(f"| {r.check} | {r.status} | {r.seconds:.1f} | {r.detail.replace('|', '/')} |")
    return "\n".join(lines) + "\n"


def write_section(path: str, section: str) -> None:
    """Replace (or append) the GPU check section of docs/benchmarks.md, leaving the others."""
    assert section.startswith(SECTION + "\n"), section[:40]
    replace_section(path, section)


def _key_value(text: str) -> tuple:
    if "=" not in text:
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {text!r}")
    k, v = text.split("=", 1)
    return k, int(v) if v.lstrip("-").isdigit() else v


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--budget-s", type=float, default=540.0, help="stop starting checks after this (default 540)")
    p.add_argument("--bench-spec", default=BENCH_SPEC)
    p.add_argument("--micro-batch", type=int, default=8)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--gemm-n", type=int, default=8192)
    p.add_argument("--set", type=_key_value, action="append", default=[], metavar="KEY=VALUE",
                   help="override a config value of the bench spec (e.g. num_layers=2)")
    p.add_argument("--output", default=os.path.join(ROOT, "docs", "benchmarks.md"))
    p.add_argument("--json", help="also write the results as JSON here")
    p.add_argument("--no-write", action="store_true", help="print only; leave docs/benchmarks.md alone")
    args = p.parse_args(argv)
    machine = Machine.detect(args.device)
    start = time.perf_counter()
    results = run_checks(machine, args)
    elapsed = time.perf_counter() - start
    section = render(machine, results, elapsed, datetime.date.today().isoformat())
    print(section)
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump({"machine": dataclasses.asdict(machine), "elapsed_s": elapsed,
                       "results": [dataclasses.asdict(r) for r in results]}, f, indent=1, sort_keys=True)
    if not args.no_write:
        write_section(args.output, section)
        print(f"wrote {args.output}")
    return 1 if any(r.status == "fail" for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
