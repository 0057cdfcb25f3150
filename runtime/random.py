"""Named random streams (Megatron's RNG tracker).

Dropout in a replicated region must draw the same mask on every tensor-parallel
rank ("default" stream); dropout on sharded values (attention heads) must differ
per rank ("tensor-parallel" stream). Torch's dropout kernels only read the
default generator, so fork() swaps a stream's state into it and back out.

Context parallelism: every CP rank holds other tokens of the same samples, so both
streams also differ per CP rank (`cp_rank`), and the masks of a sequence's chunks are
independent, as at CP=1. Megatron seeds its streams without the CP rank (its CP ranks drop
the same positions of their chunks); specc does not copy that. CP rank 0 keeps the seeds of
a run without CP. Data-parallel ranks share the streams, as in Megatron.
"""

from __future__ import annotations

import contextlib

import torch

# Megatron's offset for the tensor-parallel stream.
_TP_SEED_OFFSET = 2718
# Per context-parallel rank, both streams move by this (prime, far above any TP rank + 2718,
# so no stream of one CP rank has the seed of a stream of another).
_CP_SEED_OFFSET = 1_000_003


class RNGTracker:
    """Named streams; with `tp_invariant=True` (a debug mode for `specc verify`) dropout masks
    are instead drawn for the FULL tensor from (seed, call number) and each rank keeps its slice,
    so any TP size drops exactly what TP=1 drops."""

    def __init__(self, seed: int, tp_rank: int, tp_invariant: bool = False, cp_rank: int = 0):
        # CUDA kernels read the CUDA generator, so streams carry its state too when
        # CUDA is present; on CPU-only machines a stream is the CPU state alone.
        self.seed, self.tp_invariant, self.calls = seed, tp_invariant, 0
        self._cuda = torch.cuda.is_available()
        self._states: dict[str, dict[str, torch.Tensor]] = {}
        self._active: set[str] = set()
        base = seed + _CP_SEED_OFFSET * cp_rank  # each CP rank's tokens get their own masks
        self.add("default", base)
        self.add("tensor-parallel", base + _TP_SEED_OFFSET + tp_rank)

    def add(self, name: str, seed: int) -> None:
        if name in self._states:
            raise ValueError(f"RNG stream {name!r} already exists")
        state = {"cpu": torch.Generator().manual_seed(seed).get_state()}
        if self._cuda:
            state["cuda"] = torch.Generator(device="cuda").manual_seed(seed).get_state()
        self._states[name] = state

    @contextlib.contextmanager
    def fork(self, name: str = "tensor-parallel"):
        """Make stream `name` torch's active generator inside the block; the stream
        advances, and the previous generator state is restored on exit."""
        if name not in self._states:
            raise KeyError(f"unknown RNG stream {name!r}; known: {sorted(self._states)}")
        if name in self._active:
            raise RuntimeError(f"RNG stream {name!r} is already forked (nested fork of the same stream)")
        saved = self._swap_in(self._states[name])
        self._active.add(name)
        try:
            yield
        finally:
            self._active.discard(name)
            self._states[name] = self._swap_in(saved)

    def full_keep_mask(self, full_shape, p: float, device=None) -> torch.Tensor:
        """TP-invariant mode: the keep-mask of the next dropout call, drawn for the full tensor."""
        gen = torch.Generator().manual_seed((self.seed * 1_000_003 + self.calls) % (2**63))
        self.calls += 1
        return (torch.rand(tuple(full_shape), generator=gen) >= p).to(device)

    def get_states(self) -> dict[str, dict[str, torch.Tensor]]:
        """A copy of every stream's state, for checkpoints."""
        return {name: {k: v.clone() for k, v in state.items()} for name, state in self._states.items()}

    def set_states(self, states: dict[str, dict[str, torch.Tensor]]) -> None:
        if self._active:
            raise RuntimeError("cannot set RNG states while a stream is forked")
        self._states = {name: {k: v.clone() for k, v in state.items()} for name, state in states.items()}

    def snapshot(self) -> tuple:
        """Every stream's state and the TP-invariant mode's call count: what a recomputed forward
        must start from to draw the masks its first run drew (runtime.recompute)."""
        return {name: dict(state) for name, state in self._states.items()}, self.calls

    @contextlib.contextmanager
    def replaying(self, snapshot: tuple):
        """Run the block from `snapshot` (a recompute in backward: the same dropout masks as the
        forward it repeats), then put back the streams as they were: the recompute consumes no
        randomness of the steps after it."""
        if self._active:
            raise RuntimeError("cannot replay RNG states while a stream is forked")
        current = self.snapshot()
        self._states, self.calls = {name: dict(state) for name, state in snapshot[0].items()}, snapshot[1]
        try:
            yield
        finally:
            self._states, self.calls = current

    def _swap_in(self, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Install `state` as torch's current generator state; return the one replaced."""
        previous = {"cpu": torch.get_rng_state()}
        torch.set_rng_state(state["cpu"])
        if "cuda" in state:
            previous["cuda"] = torch.cuda.get_rng_state()
            torch.cuda.set_rng_state(state["cuda"])
        return previous
