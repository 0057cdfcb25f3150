"""The shared-memory transport against torch.distributed (gloo) on the same inputs, bit for bit."""

import os

import pytest
import torch
import torch.distributed as dist

from runtime import comm
from runtime.comm import CommCounter, CommTimer
from runtime.cpu.shared_memory import SLOT_BYTES, choose, open_transports, segment_bytes, supported_here
from runtime.parallel_state import ProcessGroups

pytestmark = pytest.mark.skipif(supported_here() is not None, reason=f"no shared-memory transport: {supported_here()}")

DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.int64)


def _values(rank: int, shape, dtype, salt: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * rank + salt)
    if dtype.is_floating_point:
        return torch.randn(shape, generator=g).to(dtype)  # sums of these round: the order shows
    return torch.randint(-1000, 1000, shape, generator=g, dtype=dtype)


def _groups(slot_bytes: int):
    """The world as one tp group twice: through shared memory (slots of `slot_bytes`; small ones
    send every tensor below in several pieces) and through gloo."""
    plain = ProcessGroups.initialize(tp=dist.get_world_size(), transport="torch")
    assert plain.tp.transport is None and plain.transport_reasons == {"tp": "transport 'torch' chosen"}
    groups, reasons = open_transports({"tp": plain.tp}, "shm", slot_bytes)
    assert groups["tp"].transport is not None and reasons == {}
    return groups["tp"], plain


def _check_sum(got, want, parts):
    """`got` is the rank-order sum of `parts` (rows: the ranks' inputs) to the bit; `want`, gloo's
    sum, may add in another order: each sum rounds at most (ranks - 1) times, by at most half an
    ulp of a partial sum, and a partial sum is at most the sum of magnitudes."""
    expected = parts[0] + parts[1]
    for j in range(2, len(parts)):
        expected = expected + parts[j]
    assert torch.equal(got, expected)
    if not got.dtype.is_floating_point:
        assert torch.equal(got, want)
        return
    bound = (len(parts) - 1) * torch.finfo(got.dtype).eps * parts.double().abs().sum(0)
    assert bool(((got.double() - want.double()).abs() <= bound).all()), (got - want).abs().max()


def _gathered(t, plain):
    out = torch.empty(plain.tp.size * t.numel(), dtype=t.dtype)
    comm.all_gather_into_tensor(out, t.contiguous(), plain.tp)
    return out.view(plain.tp.size, *t.shape)


def _check_against_gloo(rank, world, slot_bytes):
    shm, plain = _groups(slot_bytes)
    try:
        for dtype in DTYPES:
            for n in (0, 1, 37, 1000):
                x = _values(rank, (n,), dtype, salt=n)
                for op in ("sum", "max", "min"):
                    got, want = x.clone(), x.clone()
                    comm.all_reduce(got, shm, op=op)
                    comm.all_reduce(want, plain.tp, op=op)
                    if op == "sum":
                        _check_sum(got, want, _gathered(x, plain))
                    else:
                        assert torch.equal(got, want), (dtype, n, op)
                got, want = torch.empty(world * n, dtype=dtype), torch.empty(world * n, dtype=dtype)
                comm.all_gather_into_tensor(got, x, shm)
                comm.all_gather_into_tensor(want, x, plain.tp)
                assert torch.equal(got, want), (dtype, n)
                full = _values(rank, (world * n,), dtype, salt=n + 1)
                got, want = torch.empty(n, dtype=dtype), torch.empty(n, dtype=dtype)
                comm.reduce_scatter_tensor(got, full, shm)
                comm.reduce_scatter_tensor(want, full, plain.tp)
                _check_sum(got, want, _gathered(full, plain)[:, rank * n:(rank + 1) * n])
                got, want = torch.full((n,), -1).to(dtype), torch.full((n,), -2).to(dtype)
                for work in comm.ring_exchange(x, got, shm) + comm.ring_exchange(x, want, plain.tp):
                    work.wait()
                assert torch.equal(got, want), (dtype, n)
                assert torch.equal(got, _gathered(x, plain)[(rank - 1) % world]), (dtype, n)
        _check_ring_exchanges_in_flight(rank, world, shm, plain)
        _check_in_place_and_async(rank, world, shm, plain)
        return _same_on_every_rank(rank, world, shm, plain)
    finally:
        plain.destroy()


def _check_in_place_and_async(rank, world, shm, plain):
    # all-gather into the tensor whose chunk is the input (the distributed optimizer's param gather)
    n = 300
    out = torch.zeros(world * n)
    out[rank * n:(rank + 1) * n] = _values(rank, (n,), torch.float32)
    expected = torch.empty(world * n)
    comm.all_gather_into_tensor(expected, out[rank * n:(rank + 1) * n].clone(), plain.tp)
    comm.all_gather_into_tensor(out, out[rank * n:(rank + 1) * n], shm)
    assert torch.equal(out, expected)
    # reduce-scatter into this rank's chunk of its own input
    full = _values(rank, (world * n,), torch.float32, salt=5)
    expected, parts = torch.empty(n), _gathered(full, plain)[:, rank * n:(rank + 1) * n]
    comm.reduce_scatter_tensor(expected, full.clone(), plain.tp)
    comm.reduce_scatter_tensor(full[rank * n:(rank + 1) * n], full, shm)
    _check_sum(full[rank * n:(rank + 1) * n], expected, parts)
    # async: an all-reduce left pending while other collectives run, waited on last; each issue
    # finishes the one before it (its slot set is then free), wait() on a finished one is a no-op
    a, b, c = (_values(rank, (n,), torch.float32, salt=s) for s in (7, 8, 9))
    inputs = [_gathered(t, plain) for t in (a, b, c)]
    a_ref, b_ref, c_ref = a.clone(), b.clone(), c.clone()
    for t in (a_ref, b_ref, c_ref):
        comm.all_reduce(t, plain.tp)
    work_a = comm.all_reduce(a, shm, async_op=True)
    work_b = comm.all_reduce(b, shm, async_op=True)
    assert work_a.is_completed()  # issuing b finished a
    comm.all_reduce(c, shm)
    assert work_b.is_completed()
    work_b.wait()
    work_a.wait()
    for got, want, parts in zip((a, b, c), (a_ref, b_ref, c_ref), inputs):
        _check_sum(got, want, parts)


def _check_ring_exchanges_in_flight(rank, world, shm, plain):
    """The CP ring's backward: K/V and the dK/dV accumulators shifted at once, waited on after the
    block's computation; the second issue finishes the first. Each lands on the next rank, both
    counted as a send and a receive, as through gloo."""
    kv, dkv = _values(rank, (2, 70), torch.float32, salt=21), _values(rank, (2, 70), torch.float32, salt=22)
    kv_in, dkv_in, sent = torch.empty_like(kv), torch.empty_like(dkv), kv.clone()
    with CommCounter() as shm_count:
        works = comm.ring_exchange(kv, kv_in, shm, tag=11) + comm.ring_exchange(dkv, dkv_in, shm, tag=12)
        kv.add_(1.0)  # the message was taken when issued: changing the tensor after is safe
    for work in works:
        work.wait()
    assert torch.equal(kv_in.view(-1), _gathered(sent.view(-1), plain)[(rank - 1) % world])
    assert torch.equal(dkv_in.view(-1), _gathered(dkv.view(-1), plain)[(rank - 1) % world])
    with CommCounter() as gloo_count:
        for work in comm.ring_exchange(dkv, dkv_in, plain.tp):
            work.wait()
    assert shm_count.totals() == {"send": (2, 2 * 560), "recv": (2, 2 * 560)}
    assert gloo_count.totals() == {"send": (1, 560), "recv": (1, 560)}
    with pytest.raises(ValueError, match="the sent and received tensors differ"):
        comm.ring_exchange(kv, torch.empty(3), shm)


def _same_on_every_rank(rank, world, shm, plain):
    """A sum through shared memory is the same bits on every rank (what replicated values need)."""
    x = _values(rank, (513,), torch.float32, salt=11)
    comm.all_reduce(x, shm)
    everyone = torch.empty(world * 513)
    comm.all_gather_into_tensor(everyone, x, plain.tp)
    parts = everyone.view(world, 513)
    assert all(torch.equal(parts[0], parts[j]) for j in range(world))
    return x.sum().item()


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("slot_bytes", [SLOT_BYTES, 192])
def test_matches_gloo(gloo, world, slot_bytes):
    sums = gloo.run(world, _check_against_gloo, slot_bytes)
    assert len(set(sums)) == 1


def _check_counted_timed_and_unlinked(rank, world):
    pg = ProcessGroups.initialize(tp=world, transport="shm")
    try:
        assert os.path.basename(pg.tp.transport.path).startswith("specc-")
        assert not os.path.exists(pg.tp.transport.path)  # unlinked once every rank had mapped it
        with CommCounter() as counter, CommTimer() as timer:
            x = torch.ones(10)
            work = comm.all_reduce(x, pg.tp, async_op=True)
            assert type(work).__name__ == "_TimedWork"
            work.wait()
            out = torch.empty(world * 10)
            comm.all_gather_into_tensor(out, x, pg.tp)
        assert torch.equal(x, torch.full((10,), float(world)))
        assert counter.totals() == {"all_reduce": (1, 40), "all_gather": (1, world * 40)}
        assert [r for r, _, _ in timer.records] == counter.records
        assert timer.replay() > 0
    finally:
        pg.destroy()


def test_counted_timed_and_unlinked(gloo):
    gloo.run(2, _check_counted_timed_and_unlinked)


def _check_a_missing_rank_times_out(rank, world):
    pg = ProcessGroups.initialize(tp=world, transport="shm")
    try:
        if rank == 0:
            pg.tp.transport.timeout_s = 0.3
            with pytest.raises(RuntimeError, match=r"group 'tp': rank\(s\) \[1\] of the group did not reach operation 1"):
                comm.all_reduce(torch.ones(3), pg.tp)
    finally:
        dist.barrier()
        pg.destroy()


def test_a_missing_rank_times_out(gloo):
    gloo.run(2, _check_a_missing_rank_times_out)


def _check_bad_transport(rank, world):
    with pytest.raises(ValueError, match="transport must be one of auto, shm, torch, got 'nccl'"):
        ProcessGroups.initialize(tp=world, transport="nccl")


def test_bad_transport_name(gloo):
    gloo.run(2, _check_bad_transport)


def _facts(host="h", cpus=4, free=1 << 40, why_not=None, **groups):
    cores = list(range(cpus)) if isinstance(cpus, int) else cpus
    return {"host": host, "cpus": cores, "free": free, "why_not": why_not, "groups": groups}


def test_choose_keeps_a_group_to_one_host_with_a_core_per_rank():
    two = [_facts(tp=(0, 1)), _facts(tp=(0, 1))]
    assert choose(two, "auto") == {}
    # more ranks on the host than cores: auto keeps torch.distributed, shm insists
    crowded = [_facts(cpus=2, tp=(0, 1, 2)) for _ in range(3)]
    assert choose(crowded, "auto") == {("tp", (0, 1, 2)): "3 ranks share 2 cores on this host "
                                                          "(transport 'shm' uses it anyway)"}
    assert choose(crowded, "shm") == {}
    # ranks pinned to cores of their own count every core of the host, not one rank's share
    pinned = [_facts(cpus=[r], tp=(0, 1)) for r in range(2)]
    assert choose(pinned, "auto") == {}
    stacked = [_facts(cpus=[0], tp=(0, 1)) for _ in range(2)]
    assert choose(stacked, "auto") == {("tp", (0, 1)): "2 ranks share 1 cores on this host "
                                                       "(transport 'shm' uses it anyway)"}
    # a data-parallel group across two hosts; the tensor-parallel groups stay within one
    split = [_facts(host="a", tp=(0, 1), dp=(0, 2)), _facts(host="a", tp=(0, 1), dp=(1, 3)),
             _facts(host="b", tp=(2, 3), dp=(0, 2)), _facts(host="b", tp=(2, 3), dp=(1, 3))]
    assert choose(split, "auto") == {("dp", (0, 2)): "its ranks are on more than one host",
                                     ("dp", (1, 3)): "its ranks are on more than one host"}
    odd = [_facts(tp=(0, 1)), _facts(why_not="it relies on x86-64's store order and this host is arm64", tp=(0, 1))]
    assert choose(odd, "auto") == {("tp", (0, 1)): "it relies on x86-64's store order and this host is arm64"}


def test_choose_falls_back_when_dev_shm_is_small():
    need = segment_bytes(2) * 2  # tp and dp of 2 ranks each
    facts = [_facts(free=need - 1, tp=(0, 1), dp=(0, 1)), _facts(free=need, tp=(0, 1), dp=(0, 1))]
    reasons = choose(facts, "auto")
    assert set(reasons) == {("tp", (0, 1)), ("dp", (0, 1))}
    assert all("/dev/shm has less free space than the" in why for why in reasons.values())
    facts[0]["free"] = need
    assert choose(facts, "auto") == {}


def _check_compiled_layers(rank, world):
    """torch.compile breaks the graph at the transport (it runs eagerly, in order): compiled layers
    give eager's loss and gradients, and later steps, whose operation numbers differ, do not
    recompile."""
    import torch._dynamo

    import specc_torch
    from runtime.compile import compile_layers

    spec = os.path.join(os.path.dirname(__file__), "..", "..", "specs", "gpt-tiny.yaml")
    pg = ProcessGroups.initialize(tp=world, transport="shm")
    try:
        eager, compiled = (specc_torch.build_model(spec, pg, seed=5, sp=True) for _ in range(2))
        compile_layers(compiled, "aot_eager")
        tokens = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(1))

        def step(model):
            model.zero_grad(set_to_none=True)
            loss = model(tokens, tokens).mean()
            loss.backward()
            return loss.detach(), [p.grad.clone() for p in model.parameters()]

        ref_loss, ref = step(eager)
        for i in range(3):
            with torch._dynamo.config.patch(error_on_recompile=i > 0):
                loss, got = step(compiled)
            torch.testing.assert_close(loss, ref_loss, rtol=1e-6, atol=1e-6)
            for g, r in zip(got, ref):
                assert (g - r).abs().max().item() <= 1e-5 * r.abs().max().item() + 1e-7
    finally:
        pg.destroy()


def test_compiled_layers_run_the_transport_eagerly(gloo):
    from runtime.cpu.shared_memory import SharedMemoryTransport, SharedMemoryWork

    # traced, the transport costs 1.2x the step under inductor (bench/megatron_step.py --torch-compile)
    entries = (SharedMemoryTransport.all_reduce, SharedMemoryTransport.all_gather, SharedMemoryTransport.reduce_scatter,
               SharedMemoryWork.wait)
    assert all(getattr(f, "_torchdynamo_disable", False) for f in entries)
    gloo.run(2, _check_compiled_layers)


def _check_one_rank_cannot(rank, world):
    """When one rank of a group cannot map the segment, every rank learns it: auto keeps the
    group on torch.distributed everywhere, shm fails everywhere (no rank is left waiting)."""
    from runtime.cpu import shared_memory
    from runtime.cpu.shared_memory import TransportError

    saved = shared_memory.supported_here
    if rank == 1:
        shared_memory.supported_here = lambda: "it relies on x86-64's store order and this host is riscv64"
    try:
        pg = ProcessGroups.initialize(tp=world)
        assert pg.tp.transport is None
        assert pg.transport_reasons == {"tp": "it relies on x86-64's store order and this host is riscv64"}
        assert pg.transport_summary() == ("collectives on CPU tensors: tp (it relies on x86-64's store order and "
                                          "this host is riscv64) through torch.distributed")
        x = torch.ones(4)
        comm.all_reduce(x, pg.tp)
        assert torch.equal(x, torch.full((4,), float(world)))
        pg.destroy()
        with pytest.raises(TransportError, match=r"group 'tp' \(ranks \[0, 1\]\): it relies on x86-64's store order"):
            ProcessGroups.initialize(tp=world, transport="shm")
    finally:
        shared_memory.supported_here = saved
        dist.barrier()


def test_a_rank_that_cannot_map_the_segment_decides_for_its_group(gloo):
    gloo.run(2, _check_one_rank_cannot)


def _check_misuse_raises(rank, world):
    """Ranks that issue different collectives get an error, not each other's stale bytes; a
    destroyed group's transport refuses; a tensor that requires grad is reduced as gloo does."""
    pg = ProcessGroups.initialize(tp=world, transport="shm")
    try:
        leaf = torch.full((3,), float(rank + 1), requires_grad=True)
        comm.all_reduce(leaf, pg.tp)
        assert torch.equal(leaf.detach(), torch.full((3,), 3.0))
        with pytest.raises(RuntimeError, match=r"collective 2 on group 'tp': the ranks issued different collectives "
                                               r"\(rank 0: all_reduce:sum of 4 torch.float32 elements \(from 0\); "
                                               r"rank 1: all_reduce:sum of 3 torch.float32"):
            comm.all_reduce(torch.ones(4 - rank), pg.tp)
    finally:
        pg.destroy()
    with pytest.raises(RuntimeError, match="transport of group 'tp' is closed"):
        comm.all_reduce(torch.ones(2), pg.tp)


def test_misuse_raises(gloo):
    gloo.run(2, _check_misuse_raises)


def _check_a_failed_segment_is_agreed(rank, world):
    """A segment its creator cannot allocate (a full /dev/shm) fails on every rank alike: auto
    falls back to torch.distributed, shm raises; no file is left behind."""
    from runtime.cpu.shared_memory import TransportError

    real = os.posix_fallocate

    def full(fd, offset, length):
        raise OSError(28, "No space left on device")

    if rank == 0:
        os.posix_fallocate = full
    try:
        before = {f for f in os.listdir("/dev/shm") if f.startswith("specc-")}
        pg = ProcessGroups.initialize(tp=world)
        assert pg.tp.transport is None
        assert pg.transport_reasons["tp"].startswith("rank 0: creating /dev/shm/specc-")
        assert pg.transport_reasons["tp"].endswith(": No space left on device")
        pg.destroy()
        with pytest.raises(TransportError, match="rank 0: creating .*No space left on device"):
            ProcessGroups.initialize(tp=world, transport="shm")
        assert {f for f in os.listdir("/dev/shm") if f.startswith("specc-")} == before
    finally:
        os.posix_fallocate = real
        dist.barrier()


def test_a_failed_segment_is_agreed(gloo):
    gloo.run(2, _check_a_failed_segment_is_agreed)
