import pytest
import torch
import torch.distributed as dist

from runtime import comm, mappings
from runtime.comm import CommCounter, CommTimer
from runtime.layers import ColumnParallelLinear, RowParallelLinear
from runtime.parallel_state import Group

F32 = 4  # bytes


def world_group(rank: int, world: int, name: str = "tp") -> Group:
    return Group(size=world, rank=rank, group=dist.group.WORLD, ranks=tuple(range(world)), name=name)


def test_size_one_group_is_a_silent_no_op():
    g = Group.single("tp")
    x = torch.arange(4.0)
    with CommCounter() as c:
        assert comm.all_reduce(x, g) is None
        out = torch.empty(4)
        assert comm.all_gather_into_tensor(out, x, g) is None
        rs = torch.empty(4)
        assert comm.reduce_scatter_tensor(rs, x, g) is None
    assert torch.equal(x, torch.arange(4.0))
    assert torch.equal(out, x) and torch.equal(rs, x)  # the one-rank result is the input
    assert c.records == [] and c.totals() == {}


def test_counters_nest_and_stop_on_exit():
    fake = Group(size=2, rank=0, group=None, ranks=(0, 1), name="tp")
    with CommCounter() as outer:
        CommCounter._record("all_reduce", fake, torch.empty(3))
        with CommCounter() as inner:
            CommCounter._record("all_gather", fake, torch.empty(5, dtype=torch.float64))
        CommCounter._record("all_reduce", fake, torch.empty(1))
    CommCounter._record("all_reduce", fake, torch.empty(7))  # no counter active: dropped
    assert inner.totals() == {"all_gather": (1, 40)}
    assert outer.totals() == {"all_reduce": (2, 16), "all_gather": (1, 40)}
    assert [r.group for r in outer.records] == ["tp"] * 3
    assert CommCounter._active == []


def test_counter_is_removed_when_the_block_raises():
    with pytest.raises(KeyError):
        with CommCounter():
            raise KeyError("x")
    assert CommCounter._active == []


def _check_collectives(rank, world):
    g = world_group(rank, world)
    with CommCounter() as c:
        x = torch.full((3,), float(rank + 1))
        comm.all_reduce(x, g)
        assert torch.equal(x, torch.full((3,), world * (world + 1) / 2))
        m = torch.tensor([float(rank)])
        comm.all_reduce(m, g, op="max")
        assert m.item() == world - 1

        out = torch.empty(world * 2, 3)
        work = comm.all_gather_into_tensor(out, torch.full((2, 3), float(rank)), g, async_op=True)
        work.wait()
        assert torch.equal(out, torch.arange(world).float().repeat_interleave(2)[:, None].expand(-1, 3))

        inp = torch.arange(world * 2.0)[:, None].expand(-1, 3).contiguous() + rank
        rs = torch.empty(2, 3)
        comm.reduce_scatter_tensor(rs, inp, g, async_op=True).wait()
        expected = world * torch.arange(rank * 2.0, rank * 2.0 + 2)[:, None] + sum(range(world))
        assert torch.equal(rs, expected.expand(2, 3))

        with pytest.raises(ValueError, match="does not match"):
            comm.all_gather_into_tensor(torch.empty(5), torch.empty(2), g)
        with pytest.raises(ValueError, match="op must be one of"):
            comm.all_reduce(x, g, op="avg")
    assert c.totals() == {
        "all_reduce": (2, 3 * F32 + 1 * F32),
        "all_gather": (1, world * 2 * 3 * F32),  # the gathered output
        "reduce_scatter": (1, world * 2 * 3 * F32),  # the full input
    }
    assert {r.group for r in c.records} == {"tp"}


@pytest.mark.parametrize("world", [2, 4])
def test_collectives(gloo, world):
    gloo.run(world, _check_collectives)


def _check_backward_is_counted(rank, world):
    g = world_group(rank, world)
    x = torch.randn(4, 2, requires_grad=True)
    with CommCounter() as c:
        y = mappings.copy_to_tensor_model_parallel_region(x, g)
        assert c.totals() == {}  # forward identity
        y.sum().backward()
    assert c.totals() == {"all_reduce": (1, 8 * F32)}


def _linear_pair_counts(rank, world, sequence_parallel):
    """Counts of one column -> row pair (an MLP without the activation)."""
    g = world_group(rank, world)
    s, b, h, ffn = 8, 2, 6, 16
    col = ColumnParallelLinear(h, ffn, tp=g, input_mode="gather" if sequence_parallel else "copy")
    row = RowParallelLinear(ffn, h, tp=g)
    for p in (*col.parameters(), *row.parameters()):
        torch.nn.init.normal_(p)
    x = torch.randn(s // world if sequence_parallel else s, b, h, requires_grad=True)
    with CommCounter() as fwd:
        y = row(col(x))
        if sequence_parallel:
            y = mappings.reduce_scatter_to_sequence_parallel_region(y, g)
        else:
            y = mappings.reduce_from_tensor_model_parallel_region(y, g)
    with CommCounter() as bwd:
        y.sum().backward()
    return fwd.totals(), bwd.totals()


def _check_linear_pair_counts(rank, world):
    full = 8 * 2 * 6 * F32  # one [s, b, h] fp32 activation
    fwd, bwd = _linear_pair_counts(rank, world, sequence_parallel=False)
    # TP: one all-reduce forward (output), one backward (the column's grad-input).
    assert fwd == {"all_reduce": (1, full)}, fwd
    assert bwd == {"all_reduce": (1, full)}, bwd
    fwd, bwd = _linear_pair_counts(rank, world, sequence_parallel=True)
    # TP+SP: all-gather + reduce-scatter forward; backward the reduce-scatter's
    # all-gather, the column's input re-gather and its grad-input reduce-scatter.
    assert fwd == {"all_gather": (1, full), "reduce_scatter": (1, full)}, fwd
    assert bwd == {"all_gather": (2, 2 * full), "reduce_scatter": (1, full)}, bwd
    _check_timer(rank, world)


def _check_timer(rank, world):
    """CommTimer sees the same collectives as CommCounter, the async ones through their wait(),
    and replays them alone; it hands out the plain work handle when no timer is active."""
    g = world_group(rank, world)
    with CommTimer() as timer, CommCounter() as counter:
        _linear_pair_counts(rank, world, sequence_parallel=True)
        work = comm.all_reduce(torch.ones(3), g, async_op=True)
        assert type(work).__name__ == "_TimedWork"
        work.wait()
    assert [r for r, _, _ in timer.records] == counter.records
    assert all(seconds >= 0.0 for _, _, seconds in timer.records)
    assert timer.exposed_seconds() == sum(seconds for _, _, seconds in timer.records)
    recorded = list(timer.records)
    assert timer.replay() > 0.0
    assert timer.records == recorded  # the replay is not recorded (the timer is no longer active)
    plain = comm.all_reduce(torch.ones(3), g, async_op=True)
    assert type(plain).__name__ != "_TimedWork"
    plain.wait()
    assert CommTimer._active == []


@pytest.mark.parametrize("world", [2, 4])
def test_counts_forward_and_backward(gloo, world):
    gloo.run(world, _check_backward_is_counted)
    gloo.run(world, _check_linear_pair_counts)
