"""What a step achieves against what the device can do: the peak (measured once per run with a
GEMM, or given), TFLOP/s and MFU from the compiled plan's FLOP count, and the memory a step
holds, measured where it can be measured honestly.

MFU (model FLOPs utilization, PaLM's term) = the FLOPs the model's matrix multiplies need per
second / the peak of the device. The FLOPs come from the compiler (plan.json:
totals.flops_per_step, per rank and micro-batch), not from a formula here: runtime/ knows
nothing of the model."""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Peak:
    tflops: float  # per rank
    source: str  # how it was obtained, for the log

    def mfu(self, tflops: float) -> float:
        return tflops / self.tflops


_MEASURED: dict = {}  # (device, dtype, threads) -> Peak: one measurement per run (and process)


def measure_peak(device: torch.device, dtype: torch.dtype, seconds: float = 0.25) -> Peak:
    """The TFLOP/s of a square torch.mm in the run's dtype, on its device with its thread count:
    what a perfect matrix multiply achieves here, which MFU compares against. Warmed up, then
    timed over at least `seconds` (and at least 3 products)."""
    threads = torch.get_num_threads()
    key = (str(device), dtype, threads)
    if key in _MEASURED:
        return _MEASURED[key]
    n = 8192 if device.type == "cuda" else 1024
    gen = torch.Generator(device="cpu").manual_seed(0)
    a = torch.randn(n, n, generator=gen).to(device=device, dtype=dtype)
    b = torch.randn(n, n, generator=gen).to(device=device, dtype=dtype)
    out = torch.empty(n, n, device=device, dtype=dtype)
    torch.mm(a, b, out=out)
    _sync(device)
    reps, start = 0, time.perf_counter()
    while reps < 3 or time.perf_counter() - start < seconds:
        torch.mm(a, b, out=out)
        reps += 1
        if device.type == "cuda" and reps % 8 == 0:
            _sync(device)
    _sync(device)
    elapsed = time.perf_counter() - start
    where = f"{device.type}, {threads} thread{'s' if threads > 1 else ''}" if device.type == "cpu" else \
        torch.cuda.get_device_name(device)
    peak = Peak(2 * n ** 3 * reps / elapsed / 1e12,
                f"measured: {str(dtype).replace('torch.', '')} torch.mm {n}x{n}x{n} on {where}")
    _MEASURED[key] = peak
    return peak


def given_peak(tflops: float) -> Peak:
    return Peak(tflops, "given by --peak-tflops")


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def tensor_bytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


class SavedActivations:
    """Bytes autograd keeps for backward while a forward runs under it (`with meter:`): each
    saved tensor's storage counted once, parameters (and what views them) excluded. That is the
    plan's `activations`: what the model keeps between forward and backward."""

    def __init__(self, params):
        self._exclude = {p.untyped_storage().data_ptr() for p in params}
        self._seen: dict = {}
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)

    def _pack(self, t):
        try:
            storage = t.untyped_storage()
        except (RuntimeError, NotImplementedError):  # a tensor without storage (a functional wrapper)
            return t
        ptr = storage.data_ptr()
        if ptr not in self._exclude:
            self._seen[ptr] = storage.nbytes()
        return t

    def __enter__(self):
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc):
        return self._hooks.__exit__(*exc)

    @property
    def total(self) -> int:
        return sum(self._seen.values())
