"""Host memory between training steps: keep what a step frees for the next one.

A training step on the CPU allocates and frees the same activations every step, blocks of a few
hundred KiB to tens of MiB. glibc's malloc serves blocks above its mmap threshold (128 KiB,
raised as it sees such blocks freed) from fresh mappings and hands them back to the kernel on
free, and trims the top of its heap past a trim threshold: so every step the kernel maps and
zeroes those pages again, a page fault per 4 KiB. On 2 ranks of this project's CPU bench that is
about 3,500 faults a step and 5-10% of the step at TP=2 (the ranks fault at different moments,
and each collective waits for the later one); at TP=1 1-4%.

CUDA has its caching allocator for this; on the CPU the field's answer is to preload jemalloc or
tcmalloc (torch.backends.xeon.run_cpu --enable-jemalloc). glibc's own two knobs get the same
effect for this allocation pattern with nothing to install: blocks up to 32 MiB (glibc's largest
mmap threshold on 64-bit) come from the heap, and up to `trim_threshold` bytes freed at its top
stay mapped. The process's resident memory then stays at its peak between steps instead of
falling back, which a training process reaches every step anyway.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import platform

M_TRIM_THRESHOLD = -1  # mallopt parameters (malloc.h)
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD_MAX = 32 << 20  # glibc on 64-bit: HEAP_MAX_SIZE / 2; larger values are refused
MODES = ("retain", "release")

_applied: str | None = None


def retain_freed_memory(trim_threshold: int = 1 << 30) -> str:
    """Have glibc's malloc keep the memory this process frees (see the module docstring); once per
    process (later calls return the first one's answer). Returns a line for the training log:
    what was set, or why nothing was (not glibc, mallopt refused)."""
    global _applied
    if _applied is not None:
        return _applied
    libc_name, _ = platform.libc_ver()
    if libc_name != "glibc":
        _applied = f"host memory: the C library's defaults (retaining freed memory needs glibc, this is {libc_name or 'another C library'})"
        return _applied
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    mmap_ok = libc.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_MAX) == 1
    trim_ok = libc.mallopt(M_TRIM_THRESHOLD, int(trim_threshold)) == 1
    if mmap_ok and trim_ok:
        _applied = (f"host memory: freed blocks up to {MMAP_THRESHOLD_MAX >> 20} MiB stay in the process for the next "
                    f"step (glibc mallopt: mmap threshold {MMAP_THRESHOLD_MAX >> 20} MiB, trim threshold "
                    f"{trim_threshold >> 20} MiB)")
    else:
        refused = [name for name, ok in (("M_MMAP_THRESHOLD", mmap_ok), ("M_TRIM_THRESHOLD", trim_ok)) if not ok]
        _applied = f"host memory: glibc refused mallopt({', '.join(refused)}); its defaults stay"
    return _applied
