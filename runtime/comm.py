"""The only place the runtime issues collectives, so that they can be counted.

Every function is a no-op (and is not counted) on a group of size 1, so a
single-process run needs no torch.distributed.
"""

from __future__ import annotations

import threading
import time
from collections import defaultdict
from dataclasses import dataclass

import torch
import torch.distributed as dist

from .parallel_state import Group

_REDUCE_OPS = {"sum": "SUM", "max": "MAX", "min": "MIN"}


def _all_gather(out, inp, **kwargs):
    # torch 2.13 renames all_gather_into_tensor to all_gather_single and deprecates
    # the old name; resolved per call so importing needs no torch.distributed.
    fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    return fn(out, inp, **kwargs)


def _reduce_scatter(out, inp, **kwargs):
    fn = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    return fn(out, inp, **kwargs)


# The kinds of collective the runtime issues and CommCounter records; the compiler's plan counts
# the same (specc.layouts.COLLECTIVES; tests/test_shared_rules.py checks the two agree).
KINDS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "send", "recv")


@dataclass(frozen=True)
class CommRecord:
    kind: str  # one of KINDS
    group: str  # Group.name
    bytes: int  # per rank, see CommCounter


class _WhileActive:
    """A context manager on a process-wide stack of its class's active instances, guarded by a
    lock rather than a contextvar: autograd may run backward on its own threads (one per CUDA
    device), which do not see the caller's contextvars, and backward collectives must count. An
    instance leaves the stack on exit, so nothing leaks between uses."""

    _active: list = []
    _lock = threading.Lock()

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        cls._active, cls._lock = [], threading.Lock()  # each kind its own stack

    def __enter__(self):
        with type(self)._lock:
            type(self)._active.append(self)
        return self

    def __exit__(self, *exc) -> None:
        with type(self)._lock:
            type(self)._active.remove(self)


class CommCounter(_WhileActive):
    """Records every collective issued while it is active.

    bytes per rank: all_reduce counts its input, all_gather its output (the gathered
    tensor), reduce_scatter its input (the full tensor), all_to_all the tensor it sends (with
    uneven splits, what this rank sends; the part kept for itself included); a point-to-point exchange
    (send_recv) records one "send" with the sent tensor and one "recv" with the
    received tensor, each on the rank that issues it.
    """

    def __init__(self) -> None:
        self.records: list[CommRecord] = []

    def totals(self) -> dict[str, tuple[int, int]]:
        """kind -> (count, bytes per rank)."""
        count: dict[str, int] = defaultdict(int)
        nbytes: dict[str, int] = defaultdict(int)
        for record in self.records:
            count[record.kind] += 1
            nbytes[record.kind] += record.bytes
        return {kind: (count[kind], nbytes[kind]) for kind in count}

    @classmethod
    def _record(cls, kind: str, group: Group, tensor: torch.Tensor) -> None:
        record = CommRecord(kind, group.name, tensor.numel() * tensor.element_size())
        with cls._lock:
            for counter in cls._active:
                counter.records.append(record)


class CommTimer(_WhileActive):
    """Times, while active, how long this rank waits on every collective: a blocking call's
    duration, or for an async one (async_op=True) the time its wait() blocks; what overlapped
    with computation does not show. `replay()` then issues the same collectives (kind, group,
    bytes) alone, one after another, to time what they cost when nothing hides them: the bench's
    fraction of collective time hidden is 1 - exposed / alone."""

    def __init__(self) -> None:
        self.records: list[tuple[CommRecord, Group, float]] = []  # (what, its group, seconds waited)

    def exposed_seconds(self) -> float:
        return sum(seconds for _, _, seconds in self.records)

    def replay(self) -> float:
        """Seconds the recorded collectives take issued alone, synchronously, in order (on every
        rank of their groups: call it on all ranks, after the timed region)."""
        start = time.perf_counter()
        for record, group, _ in self.records:
            per_rank = -(-max(1, record.bytes // 4) // group.size)  # fp32 elements, rounded up
            full, part = torch.zeros(per_rank * group.size), torch.zeros(per_rank)
            if record.kind == "all_reduce":
                all_reduce(full, group)
            elif record.kind == "all_gather":  # recorded: the gathered output
                all_gather_into_tensor(full, part, group)
            elif record.kind == "reduce_scatter":  # recorded: the full input
                reduce_scatter_tensor(part, full, group)
            elif record.kind == "all_to_all":  # recorded: what this rank sends
                all_to_all(torch.zeros_like(full), full, group)
        return time.perf_counter() - start

    @classmethod
    def _timed(cls, kind: str, group: Group, tensor: torch.Tensor, issue):
        """Issue a collective (`issue()` returns its work handle or None), timing it when a timer
        is active; an async handle comes back wrapped so that its wait() is timed."""
        if not cls._active:
            return issue()
        record = CommRecord(kind, group.name, tensor.numel() * tensor.element_size())
        start = time.perf_counter()
        work = issue()
        if work is None:
            cls._add(record, group, time.perf_counter() - start)
            return None
        cls._add(record, group, time.perf_counter() - start)  # an issue may wait too (shared memory)
        return _TimedWork(work, record, group)

    @classmethod
    def _add(cls, record: CommRecord, group: Group, seconds: float) -> None:
        with cls._lock:
            for timer in cls._active:
                timer.records.append((record, group, seconds))


class _TimedWork:
    """An async collective's handle whose wait() adds the time it blocks to the active timers."""

    def __init__(self, work, record: CommRecord, group: Group) -> None:
        self._work, self._record, self._group = work, record, group

    def wait(self, *args, **kwargs):
        start = time.perf_counter()
        out = self._work.wait(*args, **kwargs)
        seconds = time.perf_counter() - start
        with CommTimer._lock:
            for timer in CommTimer._active:
                for i in range(len(timer.records) - 1, -1, -1):
                    if timer.records[i][0] is self._record:
                        timer.records[i] = (self._record, self._group, timer.records[i][2] + seconds)
                        break
        return out

    def __getattr__(self, name):
        return getattr(self._work, name)


def all_reduce(t: torch.Tensor, group: Group, async_op: bool = False, op: str = "sum"):
    """In-place all-reduce of `t`; op is "sum" (default), "max" or "min"."""
    if group.size == 1:
        return None
    if op not in _REDUCE_OPS:
        raise ValueError(f"all_reduce op must be one of {sorted(_REDUCE_OPS)}, got {op!r}")
    _check_contiguous(t, "all_reduce tensor")
    CommCounter._record("all_reduce", group, t)
    if _shared_memory(group, t):
        return CommTimer._timed("all_reduce", group, t, lambda: group.transport.all_reduce(t, op, async_op))
    return CommTimer._timed("all_reduce", group, t, lambda: dist.all_reduce(
        t, op=getattr(dist.ReduceOp, _REDUCE_OPS[op]), group=group.group, async_op=async_op))


def all_gather_into_tensor(out: torch.Tensor, inp: torch.Tensor, group: Group, async_op: bool = False):
    """Gather every rank's `inp` into `out`, concatenated along dim 0 in rank order."""
    if group.size == 1:
        _copy_if_distinct(out, inp)
        return None
    _check_sizes("all_gather", out, inp, out.numel() == inp.numel() * group.size, group)
    _check_contiguous(out, "all_gather output")
    _check_contiguous(inp, "all_gather input")
    CommCounter._record("all_gather", group, out)
    if _shared_memory(group, out, inp):
        return CommTimer._timed("all_gather", group, out, lambda: group.transport.all_gather(out, inp, async_op))
    return CommTimer._timed("all_gather", group, out, lambda: _all_gather(out, inp, group=group.group,
                                                                           async_op=async_op))


def reduce_scatter_tensor(out: torch.Tensor, inp: torch.Tensor, group: Group, async_op: bool = False):
    """Sum `inp` over ranks and keep this rank's dim-0 chunk in `out`."""
    if group.size == 1:
        _copy_if_distinct(out, inp)
        return None
    _check_sizes("reduce_scatter", out, inp, inp.numel() == out.numel() * group.size, group)
    _check_contiguous(out, "reduce_scatter output")
    _check_contiguous(inp, "reduce_scatter input")
    CommCounter._record("reduce_scatter", group, inp)
    if _shared_memory(group, out, inp):
        return CommTimer._timed("reduce_scatter", group, inp, lambda: group.transport.reduce_scatter(out, inp,
                                                                                                     async_op))
    return CommTimer._timed("reduce_scatter", group, inp, lambda: _reduce_scatter(out, inp, group=group.group,
                                                                                   async_op=async_op))


def all_to_all(out: torch.Tensor, inp: torch.Tensor, group: Group, output_split_sizes=None,
               input_split_sizes=None, async_op: bool = False):
    """Rank r sends dim-0 chunk j of `inp` to rank j and receives chunk r of every rank into
    `out`, in rank order; split sizes (rows, one per rank) make the chunks uneven (token
    dispatch). Equal chunks when they are None."""
    if group.size == 1:
        _copy_if_distinct(out, inp)
        return None
    for sizes, t, what in ((input_split_sizes, inp, "input"), (output_split_sizes, out, "output")):
        if sizes is not None and (len(sizes) != group.size or sum(sizes) != t.shape[0]):
            raise ValueError(f"all_to_all {what} splits {list(sizes)} do not cut {t.shape[0]} rows into "
                             f"{group.size} parts (group {group.name!r})")
    _check_contiguous(out, "all_to_all output")
    _check_contiguous(inp, "all_to_all input")
    CommCounter._record("all_to_all", group, inp)
    return CommTimer._timed("all_to_all", group, inp, lambda: dist.all_to_all_single(
        out, inp, output_split_sizes=output_split_sizes, input_split_sizes=input_split_sizes, group=group.group,
        async_op=async_op))


def send_recv(send_tensor: torch.Tensor | None, dst: int | None, recv_tensor: torch.Tensor | None,
              src: int | None, group: Group, tag: int = 0) -> list:
    """Point-to-point: send `send_tensor` to group rank `dst` and receive `recv_tensor` from
    group rank `src`, both asynchronously (one batch_isend_irecv); returns the work handles
    to wait on. `dst`/`src` are ranks WITHIN `group` (translated to global ranks through
    Group.ranks). Either side may be None (send only, receive only). On a group of size 1
    the peer is this rank itself: the tensor is copied and nothing is counted.
    Messages between one pair of ranks are matched in issue order per `tag`."""
    if (send_tensor is None) != (dst is None) or (recv_tensor is None) != (src is None):
        raise ValueError("send_recv: give a tensor and a peer for each side used, or neither")
    if group.size == 1:
        if send_tensor is not None and recv_tensor is not None:
            _copy_if_distinct(recv_tensor, send_tensor)
        return []
    ops = []
    if send_tensor is not None:
        _check_peer(dst, group, "dst")
        _check_contiguous(send_tensor, "send tensor")
        CommCounter._record("send", group, send_tensor)
        ops.append(dist.P2POp(dist.isend, send_tensor, group.ranks[dst], group.group, tag))
    if recv_tensor is not None:
        _check_peer(src, group, "src")
        _check_contiguous(recv_tensor, "recv tensor")
        CommCounter._record("recv", group, recv_tensor)
        ops.append(dist.P2POp(dist.irecv, recv_tensor, group.ranks[src], group.group, tag))
    return dist.batch_isend_irecv(ops) if ops else []


def ring_exchange(send_tensor: torch.Tensor, recv_tensor: torch.Tensor, group: Group, tag: int = 0) -> list:
    """The ring's shift, a collective over `group`: every rank sends `send_tensor` to group rank + 1
    and receives group rank - 1's into `recv_tensor` (same shape and dtype on every rank), as
    context parallelism's ring attention passes K/V on; returns the work handles to wait on.
    Counted as send_recv's one "send" and one "recv". Through the group's shared-memory transport
    when it has one (runtime/cpu/shared_memory.py: gloo's sends contend with the computation they
    should run beside), else send_recv's batched isend/irecv with `tag`. On a group of size 1 the
    tensor is copied."""
    if send_tensor.shape != recv_tensor.shape or send_tensor.dtype != recv_tensor.dtype:
        raise ValueError(f"ring_exchange: the sent and received tensors differ: {tuple(send_tensor.shape)} "
                         f"{send_tensor.dtype} and {tuple(recv_tensor.shape)} {recv_tensor.dtype}")
    n = group.size
    if n == 1:
        _copy_if_distinct(recv_tensor, send_tensor)
        return []
    if not _shared_memory(group, send_tensor, recv_tensor):
        return send_recv(send_tensor, (group.rank + 1) % n, recv_tensor, (group.rank - 1) % n, group, tag)
    _check_contiguous(send_tensor, "send tensor")
    _check_contiguous(recv_tensor, "recv tensor")
    CommCounter._record("send", group, send_tensor)
    CommCounter._record("recv", group, recv_tensor)
    return [group.transport.ring_shift(recv_tensor, send_tensor, async_op=True)]


def _shared_memory(group: Group, *tensors: torch.Tensor) -> bool:
    """Whether this collective goes through the group's shared-memory transport: CPU tensors of
    one dtype on a group that has one."""
    return (group.transport is not None and all(t.device.type == "cpu" for t in tensors)
            and len({t.dtype for t in tensors}) == 1)


def _check_peer(peer: int, group: Group, what: str) -> None:
    if not 0 <= peer < group.size or peer == group.rank:
        raise ValueError(f"send_recv {what}={peer} must be another rank of group {group.name!r} "
                         f"(size {group.size}, this rank {group.rank})")


def _copy_if_distinct(out: torch.Tensor, inp: torch.Tensor) -> None:
    # With one rank the collective's result is the input itself.
    if out.data_ptr() != inp.data_ptr():
        with torch.no_grad():
            out.copy_(inp.view_as(out))


def _check_sizes(kind: str, out: torch.Tensor, inp: torch.Tensor, ok: bool, group: Group) -> None:
    if not ok:
        raise ValueError(
            f"{kind} on group {group.name!r} of size {group.size}: output shape "
            f"{tuple(out.shape)} does not match input shape {tuple(inp.shape)}"
        )


def _check_contiguous(t: torch.Tensor, what: str) -> None:
    if not t.is_contiguous():
        raise ValueError(f"{what} must be contiguous")
