"""The shared-memory transport under stress: every group of a TP x CP x DP grid issuing
collectives at once (blocking and async, every kind, several dtypes, sizes from one element to
many slots), in orders the runtime allows (each group's ranks in the same order, groups
interleaved consistently); a rank that issues something else is named; a peer that dies
mid-run is an error on the others within a bounded time, never a spin until the timeout."""

from __future__ import annotations

import datetime
import os
import queue
import random
import signal
import socket
import time

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from runtime import comm
from runtime.cpu.shared_memory import open_transports, supported_here
from runtime.parallel_state import ProcessGroups

pytestmark = pytest.mark.skipif(supported_here() is not None, reason=f"no shared-memory transport: {supported_here()}")

GROUPS = ("tp", "cp", "pp", "dp")
# small slots: tensors up to ~6 slots travel in pieces, each piece an operation of its own
SLOT_BYTES = 4096
# Integer-valued inputs in [-8, 8]: any sum of up to 16 of them is exact in every dtype below,
# so the expected result is exact whatever order a transport adds in.
DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int32, torch.int64)
KINDS = ("all_reduce", "all_gather", "reduce_scatter")
OPS = 100


def _schedule(seed: int) -> list:
    """The one global order every rank follows (each rank skips nothing: it runs every operation on
    its own group of that name): (group, kind, dtype, elements per rank, async, waits) where waits
    are the earlier async operations to wait for before this one is issued."""
    rng = random.Random(seed)
    ops, open_async = [], []
    for i in range(OPS):
        elements = rng.choice([1, 3, 17, 255, 1024, 4099, 6000])
        is_async = rng.random() < 0.5
        waits = [j for j in open_async if rng.random() < 0.4]
        open_async = [j for j in open_async if j not in waits]
        ops.append((rng.choice(GROUPS), rng.choice(KINDS), rng.choice(DTYPES), elements, is_async, waits))
        if is_async:
            open_async.append(i)
    return ops


def _input(op: int, global_rank: int, shape, dtype) -> torch.Tensor:
    g = torch.Generator().manual_seed(op * 1009 + global_rank)
    return torch.randint(-8, 9, shape, generator=g).to(dtype)


def _expected(op: int, kind: str, dtype, elements: int, group, me: int) -> torch.Tensor:
    t = group.size
    if kind == "all_gather":
        return torch.cat([_input(op, r, (elements,), dtype) for r in group.ranks])
    if kind == "all_reduce":
        total = sum(_input(op, r, (elements,), torch.int64) for r in group.ranks)
        return total.to(dtype)
    total = sum(_input(op, r, (t * elements,), torch.int64) for r in group.ranks)
    return total.view(t, elements)[me].to(dtype)


def _stress(rank, world, layout):
    plain = ProcessGroups.initialize(**layout, transport="torch")
    named = {name: getattr(plain, name) for name in GROUPS if getattr(plain, name).size > 1}
    groups, reasons = open_transports(named, "shm", SLOT_BYTES)
    assert reasons == {} and all(g.transport is not None for g in groups.values())
    try:
        pending = {}
        checked = 0
        for i, (name, kind, dtype, elements, is_async, waits) in enumerate(_schedule(seed=7)):
            for j in (j for j in waits if j in pending):  # not those of an axis of size 1
                work, out, want = pending.pop(j)
                work.wait()
                assert torch.equal(out, want), f"operation {j}"
                checked += 1
            if name not in groups:
                continue
            group = groups[name]
            if kind == "all_reduce":
                out = _input(i, rank, (elements,), dtype)
                work = comm.all_reduce(out, group, async_op=is_async)
            elif kind == "all_gather":
                out = torch.empty(group.size * elements, dtype=dtype)
                work = comm.all_gather_into_tensor(out, _input(i, rank, (elements,), dtype), group, async_op=is_async)
            else:
                out = torch.empty(elements, dtype=dtype)
                work = comm.reduce_scatter_tensor(out, _input(i, rank, (group.size * elements,), dtype), group,
                                                  async_op=is_async)
            want = _expected(i, kind, dtype, elements, group, group.rank)
            if is_async:
                pending[i] = (work, out, want)
            else:
                assert torch.equal(out, want), f"operation {i} ({name} {kind} {dtype} x{elements})"
                checked += 1
        for j, (work, out, want) in sorted(pending.items()):
            work.wait()
            assert torch.equal(out, want), f"operation {j}"
            checked += 1
        return checked
    finally:
        for g in groups.values():
            g.transport.close()
        dist.barrier()
        plain.destroy()


def test_every_group_at_once_in_allowed_orders(gloo):
    checked = gloo.run(8, _stress, dict(tp=2, cp=2, dp=2))  # 8 ranks: three of the four axes at a time
    # every rank is in each group of size 2 (3 of the 4 axes): about 3/4 of the operations are its own
    assert all(n > OPS // 2 for n in checked), checked


def _mismatch(rank, world):
    """Rank 1 issues an all-gather where rank 0 issues an all-reduce: both raise, naming both."""
    pg = ProcessGroups.initialize(tp=world, transport="shm")
    try:
        t = torch.ones(6)
        with pytest.raises(RuntimeError, match=r"the ranks issued different collectives \(rank 0: all_reduce:sum of 6 "
                                               r"torch.float32 elements \(from 0\); rank 1: all_gather of 3 "):
            if rank == 0:
                comm.all_reduce(t, pg.tp)
            else:
                comm.all_gather_into_tensor(torch.empty(6), t[:3].clone(), pg.tp)
    finally:
        dist.barrier()
        pg.destroy()


def test_a_rank_issuing_another_collective_is_named(gloo):
    gloo.run(2, _mismatch)


# -- a peer that dies ------------------------------------------------------------------------------

def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _dying(rank, world, port, results):
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=60))
    pg = ProcessGroups.initialize(tp=world, transport="shm")
    t = torch.ones(1000)
    comm.all_reduce(t, pg.tp)  # every rank alive and in step
    if rank == 1:  # issues an async operation, then is killed before the next one
        comm.all_reduce(t, pg.tp, async_op=True)
        os.kill(os.getpid(), signal.SIGKILL)
    start = time.monotonic()
    try:
        comm.all_reduce(t, pg.tp)  # rank 1's async one: its data is in its slot
        comm.all_reduce(t, pg.tp)  # one rank 1 never reaches
        results.put((rank, "no error", time.monotonic() - start))
    except RuntimeError as e:
        results.put((rank, str(e), time.monotonic() - start))
    results.close()
    results.join_thread()  # the report is written before this process ends
    os._exit(0)  # the group is broken: no teardown


def test_a_peer_killed_mid_run_is_an_error_within_a_second():
    """Rank 1 issues an async all-reduce (its data and counter are in) and is SIGKILLed before the
    next: the others finish that operation from its slot, then wait for one it never reaches."""
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    world, port = 3, _free_port()
    procs = [ctx.Process(target=_dying, args=(r, world, port, results)) for r in range(world)]
    for p in procs:
        p.start()
    got = {}
    try:
        for _ in range(world - 1):
            rank, message, waited = results.get(timeout=120)
            got[rank] = (message, waited)
    except queue.Empty:
        pytest.fail(f"the surviving ranks did not report within 120 s: {got}")
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
    assert procs[1].exitcode == -signal.SIGKILL
    assert sorted(got) == [0, 2]
    for rank, (message, waited) in got.items():
        assert "rank 1 (pid " in message and ") of the group exited before reaching operation 3" in message, message
        assert message.startswith("shared-memory collective on group 'tp': ")
        assert waited < 10, f"rank {rank} took {waited:.1f} s to notice"
