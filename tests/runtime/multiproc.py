"""Run test functions on N gloo ranks (CPU) from inside pytest.

Spawning a process costs seconds here, so a pool of N ranks is started once per
world size and reused: each call sends a top-level function to every rank, runs
fn(rank, world_size, *args) there with torch.distributed initialized, and returns
the per-rank results. A failure on any rank raises AssertionError in pytest with
the remote traceback(s). If some ranks fail while others are stuck in a
collective, the pool is killed and the next call starts a fresh one.
"""

from __future__ import annotations

import datetime
import os
import queue
import socket
import time
import traceback

import torch.multiprocessing as mp

# How long a collective may wait inside a worker, and how long a call may take.
_COLLECTIVE_TIMEOUT_S = 60
_CALL_TIMEOUT_S = 120
_STRAGGLER_GRACE_S = 5


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker_main(rank: int, world_size: int, port: int, tasks, results) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    dist.init_process_group(
        "gloo", rank=rank, world_size=world_size,
        timeout=datetime.timedelta(seconds=_COLLECTIVE_TIMEOUT_S),
    )
    try:
        while (task := tasks.get()) is not None:
            call_id, fn, args = task
            try:
                results.put((call_id, rank, True, fn(rank, world_size, *args)))
            except BaseException:  # report everything, including assertion failures
                results.put((call_id, rank, False, traceback.format_exc()))
    finally:
        dist.destroy_process_group()
    # Leave without the interpreter's teardown: torch's native one took 3-8 s per rank here, and
    # the session's pools (up to 14 ranks) close at its end. The answers are flushed first.
    results.close()
    results.join_thread()
    os._exit(0)


class DistPool:
    def __init__(self, world_size: int):
        ctx = mp.get_context("spawn")
        self.world_size = world_size
        self._tasks = [ctx.Queue() for _ in range(world_size)]
        self._results = ctx.Queue()
        port = _free_port()
        self._procs = [
            ctx.Process(target=_worker_main, args=(r, world_size, port, self._tasks[r], self._results), daemon=True)
            for r in range(world_size)
        ]
        for p in self._procs:
            p.start()
        self._calls = 0
        self.broken = False

    def run(self, fn, *args) -> list:
        """fn(rank, world_size, *args) on every rank; returns results by rank."""
        self._calls += 1
        call_id = self._calls
        for q in self._tasks:
            q.put((call_id, fn, args))
        outcomes = self._collect(call_id)
        failures = [f"--- rank {r} ---\n{payload}" for r, (ok, payload) in sorted(outcomes.items()) if not ok]
        if len(outcomes) < self.world_size:
            self.close(kill=True)
            missing = sorted(set(range(self.world_size)) - set(outcomes))
            failures.append(f"ranks {missing} did not finish (stuck in a collective or dead); the pool is restarted")
        if failures:
            raise AssertionError(f"{fn.__qualname__} failed on {self.world_size} ranks:\n" + "\n".join(failures))
        return [outcomes[r][1] for r in range(self.world_size)]

    def _collect(self, call_id: int) -> dict:
        outcomes: dict[int, tuple[bool, object]] = {}
        deadline = time.monotonic() + _CALL_TIMEOUT_S
        while len(outcomes) < self.world_size and time.monotonic() < deadline:
            try:
                cid, rank, ok, payload = self._results.get(timeout=0.5)
            except queue.Empty:
                if not all(p.is_alive() for p in self._procs):
                    break
                continue
            if cid != call_id:
                continue  # a late answer from an earlier, failed call
            outcomes[rank] = (ok, payload)
            if not ok:  # the others may be stuck waiting for the failed rank
                deadline = min(deadline, time.monotonic() + _STRAGGLER_GRACE_S)
        return outcomes

    def close(self, kill: bool = False) -> None:
        self.stop(kill)
        self.join()

    def stop(self, kill: bool = False) -> None:
        """Tells the ranks to end (or kills them), without waiting: pools end side by side."""
        self.broken = True
        if kill:
            for p in self._procs:
                p.kill()
        else:
            for q in self._tasks:
                q.put(None)

    def join(self) -> None:
        deadline = time.monotonic() + 10
        for p in self._procs:
            p.join(timeout=max(deadline - time.monotonic(), 0))
        for p in self._procs:
            if p.is_alive():
                p.kill()
                p.join(timeout=5)


class DistPools:
    """One live pool per world size, recreated after a pool is killed."""

    def __init__(self):
        self._pools: dict[int, DistPool] = {}

    def run(self, world_size: int, fn, *args) -> list:
        pool = self._pools.get(world_size)
        if pool is None or pool.broken:
            pool = self._pools[world_size] = DistPool(world_size)
        return pool.run(fn, *args)

    def close(self) -> None:
        live = [pool for pool in self._pools.values() if not pool.broken]
        for pool in live:
            pool.stop()
        for pool in live:
            pool.join()
        self._pools.clear()
