"""Collectives through shared memory for a group whose ranks share one host (CPU tensors).

gloo moves every byte through a loopback socket and wakes its own threads to do it, so on a CPU
host its collectives cost several times a memory copy, and its smallest round trip is ~1 ms on a
busy 2-core machine. Here each rank of a group maps one segment of /dev/shm: a rank copies its
input into its own slot and raises its arrival counter; once every rank's counter shows the same
operation, each rank reads the slots it needs. A sum runs in rank order on every rank, so every
rank gets the same bits (what a replicated tensor needs), whatever the group size.

torch.distributed has no intra-host shared-memory backend for CPU tensors (oneCCL's and
DeepSpeed's CPU shared-memory all-reduce are separate C++ builds that pin torch versions), which is
why this is written here; it covers all-reduce, all-gather and reduce-scatter, the collectives of
tensor and sequence parallelism and of the data-parallel gradient reduction, and the ring shift
of context parallelism's ring attention (every rank sends to the next and receives from the one
before, runtime.comm.ring_exchange). Everything else (all-to-all, the pipeline's point-to-point
sends, whose ranks do not all send at once) stays on torch.distributed.

The ring shift matters beyond speed: gloo moves a send through its own threads, which on a host
with a core per rank take that core from the rank's computation while the send is in flight: a
small model's ring attention (2 ranks on 2 cores, 512 KiB K/V messages) took 16-22 ms forward
and backward with gloo's sends, 8.5-9 ms with this shift. Here the rank copies its message into
its slot when it issues the shift and reads the previous rank's when it waits: nothing runs
beside the blocks.

Ordering: an operation's data is written with plain stores before its counter is raised, and read
after the counter is seen. x86-64 keeps stores in order as other cores see them (and loads in
order), so no fence is needed; on other architectures the transport is not used.

Slots: two sets, used by operations alternately. Before a rank writes operation k, it has finished
operation k-1 (an async operation is finished when waited on, or when the next one is issued),
and so has seen every rank arrive at k-1, which each did only after finishing k-2: the set k uses
is free. A tensor larger than a slot goes through in pieces, one operation each. So issuing an
async operation can wait, for the peers to issue the one before it on the group: the ranks of a
group must issue its collectives in the same order (as torch.distributed requires), and interleave
them with other groups' collectives in an order consistent across ranks (which gloo, whose async
issue never waits, does not require).

Each rank also writes what it issued (kind, dtype, element count, reduce op) beside its slot; a
rank that finds another rank issued something else raises, rather than read mismatched bytes.

A rank that dies mid-run (killed, out of memory) never raises its counter again: each rank writes
its process id and start time beside its counter, and a rank kept waiting checks, every
_LIVENESS_S, that the late ranks' processes still exist (and are the same processes: pids are
reused). A dead peer is an error within a fraction of a second, not after the timeout. Only peers
this rank could see when the segments were set up are checked (ranks in another pid namespace are
invisible: for them the timeout stays the bound).
"""

from __future__ import annotations

import os
import platform
import threading
import time
from dataclasses import dataclass

import torch

SHM_DIR = "/dev/shm"
SLOT_BYTES = 8 << 20  # per rank and set: 2 * group size * 8 MiB of address space, touched as used
_LINE = 64  # bytes: one arrival counter per cache line, so ranks do not share the line they write
_SPIN_S = 0.01  # then wait in 100 us sleeps: an oversubscribed host needs the core for the peer
_LIVENESS_S = 0.05  # while waiting past the spin: how often the late ranks' processes are looked at
_KINDS = ("all_reduce:sum", "all_reduce:max", "all_reduce:min", "all_gather", "reduce_scatter", "ring_shift")
_DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int32, torch.int16,
           torch.int8, torch.uint8, torch.bool)


class TransportError(ValueError):
    """Transport "shm" was asked for where a group cannot have it (one line, saying why)."""


def supported_here() -> str | None:
    """None when this host can run the transport, else why not (one line)."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return f"it relies on x86-64's store order and this host is {platform.machine()}"
    if not os.path.isdir(SHM_DIR):
        return f"{SHM_DIR} does not exist"
    return None


def segment_bytes(size: int, slot_bytes: int = SLOT_BYTES) -> int:
    return _header_bytes(size) + 2 * size * slot_bytes


def _header_bytes(size: int) -> int:
    # a line per rank for its arrival counter, and per slot set a line per rank for what it issued
    return -(-3 * size * _LINE // 4096) * 4096


@dataclass
class _Pending:
    """An issued operation not yet finished: seq is its number, finish reads the slots."""

    seq: int
    finish: object  # callable(slots: list[Tensor]) -> None
    done: bool = False


class SharedMemoryWork:
    """The handle of an async collective: wait() finishes it (waits for every rank, reads the slots)."""

    def __init__(self, transport: SharedMemoryTransport, pending: _Pending) -> None:
        self._transport, self._pending = transport, pending

    @torch.compiler.disable
    def wait(self, *args, **kwargs) -> bool:
        self._transport._finish(self._pending)
        return True

    def is_completed(self) -> bool:
        return self._pending.done


class SharedMemoryTransport:
    """One group's segment (see the module docstring). Every rank of the group must issue the same
    collectives in the same order, as with torch.distributed."""

    def __init__(self, path: str, size: int, rank: int, name: str, slot_bytes: int = SLOT_BYTES,
                 timeout_s: float = 1800.0) -> None:
        if slot_bytes % _LINE:
            raise ValueError(f"slot_bytes must be a multiple of {_LINE}, got {slot_bytes}")
        self.size, self.rank, self.name, self.path = size, rank, name, path
        self.slot_bytes, self.timeout_s = slot_bytes, timeout_s
        head = _header_bytes(size)
        self._segment = torch.from_file(path, shared=True, size=segment_bytes(size, slot_bytes), dtype=torch.uint8)
        lines = self._segment[:head].view(torch.int64)[: 3 * size * _LINE // 8].view(3, size, _LINE // 8)
        self._arrived = lines[0, :, 0]
        self._identity = lines[0, :, 1:3]  # [rank]: pid, start time (clock ticks after boot)
        self._identity[rank] = torch.tensor(_process_identity(os.getpid()) or (0, 0), dtype=torch.int64)
        self._visible = [j == rank for j in range(size)]  # peers whose process this rank can see
        self._issued = lines[1:, :, :4]  # [set, rank]: kind, dtype, elements, piece start
        self._slots = self._segment[head:].view(2, size, slot_bytes)
        self._seq = int(self._arrived[rank])  # 0 on a fresh segment
        self._pending: _Pending | None = None
        self._lock = threading.Lock()

    # -- the collectives (contiguous tensors; the caller, runtime.comm, checks shapes) ------------

    # torch.compile runs these eagerly (a graph break, as at a torch.distributed call): traced, the
    # counter's store could be reordered against the data's, and each new operation number
    # would recompile the graph
    @torch.compiler.disable
    def all_reduce(self, t: torch.Tensor, op: str = "sum", async_op: bool = False):
        flat = t.view(-1)
        reduce = {"sum": torch.add, "max": torch.maximum, "min": torch.minimum}[op]

        def piece(a: int, b: int):
            def finish(slots):
                out = flat[a:b]
                views = [s.view(t.dtype)[: b - a] for s in slots]
                reduce(views[0], views[1], out=out)
                for v in views[2:]:  # rank order: the same bits on every rank
                    reduce(out, v, out=out)
            return (lambda slot: slot.view(t.dtype)[: b - a].copy_(flat[a:b])), finish

        return self._run(f"all_reduce:{op}", t.dtype, flat.numel(), self.slot_bytes // t.element_size(), piece,
                         async_op)

    @torch.compiler.disable
    def all_gather(self, out: torch.Tensor, inp: torch.Tensor, async_op: bool = False):
        src, dst, n = inp.view(-1), out.view(self.size, -1), inp.numel()

        def piece(a: int, b: int):
            def finish(slots):
                for j, s in enumerate(slots):
                    dst[j, a:b].copy_(s.view(inp.dtype)[: b - a])
            return (lambda slot: slot.view(inp.dtype)[: b - a].copy_(src[a:b])), finish

        return self._run("all_gather", inp.dtype, n, self.slot_bytes // inp.element_size(), piece, async_op)

    @torch.compiler.disable
    def reduce_scatter(self, out: torch.Tensor, inp: torch.Tensor, async_op: bool = False):
        src, dst, t = inp.view(self.size, -1), out.view(-1), self.size

        def piece(a: int, b: int):
            def write(slot):
                slot.view(inp.dtype)[: t * (b - a)].view(t, b - a).copy_(src[:, a:b])

            def finish(slots):
                mine = [s.view(inp.dtype)[: t * (b - a)].view(t, b - a)[self.rank] for s in slots]
                out_piece = dst[a:b]
                torch.add(mine[0], mine[1], out=out_piece)
                for v in mine[2:]:
                    out_piece.add_(v)
            return write, finish

        return self._run("reduce_scatter", inp.dtype, out.numel(), self.slot_bytes // (inp.element_size() * t), piece,
                         async_op)

    @torch.compiler.disable
    def ring_shift(self, out: torch.Tensor, inp: torch.Tensor, async_op: bool = False):
        """Every rank's `inp` lands in the next rank's `out` (group rank + 1, wrapping): out gets
        the previous rank's inp. A collective: every rank of the group issues it, same size."""
        src, dst, prev = inp.view(-1), out.view(-1), (self.rank - 1) % self.size

        def piece(a: int, b: int):
            def finish(slots):
                dst[a:b].copy_(slots[prev].view(inp.dtype)[: b - a])
            return (lambda slot: slot.view(inp.dtype)[: b - a].copy_(src[a:b])), finish

        return self._run("ring_shift", inp.dtype, src.numel(), self.slot_bytes // inp.element_size(), piece, async_op)

    # -- the protocol ------------------------------------------------------------------------------

    def _run(self, kind: str, dtype: torch.dtype, n: int, per_piece: int, piece, async_op: bool):
        if self._segment is None:
            raise RuntimeError(f"the shared-memory transport of group {self.name!r} is closed "
                               f"(ProcessGroups.destroy was called)")
        if per_piece < 1:
            raise ValueError(f"shared-memory slots of {self.slot_bytes} bytes cannot hold one element per rank")
        # the results are written with out= and copy_ into the caller's tensors, as gloo does:
        # outside autograd even for a tensor that requires grad
        with self._lock, torch.no_grad():
            starts = list(range(0, n, per_piece)) or [0]
            for i, a in enumerate(starts):
                write, finish = piece(a, min(n, a + per_piece))
                what = (_KINDS.index(kind), _DTYPES.index(dtype) if dtype in _DTYPES else -1, n, a)
                pending = self._issue(write, finish, what)
                if i < len(starts) - 1 or not async_op:
                    self._finish_locked(pending)
            return SharedMemoryWork(self, pending) if async_op else None

    def _issue(self, write, finish, what: tuple) -> _Pending:
        if self._pending is not None:  # the slot set this one reuses must be free: see the docstring
            self._finish_locked(self._pending)
        seq = self._seq
        write(self._slots[seq % 2, self.rank])
        self._issued[seq % 2, self.rank] = torch.tensor(what, dtype=torch.int64)
        self._seq = seq + 1
        self._arrived[self.rank] = seq + 1  # after the data: x86-64 keeps the stores in order
        self._pending = _Pending(seq, finish)
        return self._pending

    def _finish(self, pending: _Pending) -> None:
        with self._lock, torch.no_grad():
            self._finish_locked(pending)

    def _finish_locked(self, pending: _Pending) -> None:
        if pending.done:
            return
        self._await(pending.seq + 1)
        issued = self._issued[pending.seq % 2]
        if not bool((issued == issued[self.rank]).all()):
            self._raise_mismatch(pending.seq, issued)
        pending.finish(list(self._slots[pending.seq % 2].unbind(0)))
        pending.done = True
        if self._pending is pending:
            self._pending = None

    def _raise_mismatch(self, seq: int, issued: torch.Tensor) -> None:
        def say(row) -> str:
            kind, dtype, n, start = (int(v) for v in row)
            return (f"{_KINDS[kind] if 0 <= kind < len(_KINDS) else '?'} of {n} "
                    f"{_DTYPES[dtype] if 0 <= dtype < len(_DTYPES) else 'other'} elements (from {start})")
        ranks = "; ".join(f"rank {j}: {say(row)}" for j, row in enumerate(issued.tolist()))
        raise RuntimeError(f"shared-memory collective {seq + 1} on group {self.name!r}: the ranks issued different "
                           f"collectives ({ranks}); every rank of a group must issue the same ones in the same order")

    def see_peers(self) -> None:
        """Note which peers' processes this rank can see (call once every rank has mapped the
        segment): only those are checked for liveness while waiting."""
        for j, (pid, start) in enumerate(self._identity.tolist()):
            if j != self.rank and pid > 0:
                self._visible[j] = _process_identity(pid) == (pid, start)

    def _dead(self, late: list) -> list:
        """The late ranks whose process is gone (or was replaced by another with its pid)."""
        out = []
        for j in late:
            pid, start = self._identity[j].tolist()
            if self._visible[j] and _process_identity(pid) != (pid, start):
                out.append((j, pid))
        return out

    def close(self) -> None:
        """Unmap the segment (its memory goes once every rank has closed it); later collectives raise."""
        with self._lock:
            self._pending = None
            self._segment = self._arrived = self._issued = self._slots = None

    def _await(self, count: int) -> None:
        """Until every rank has issued `count` operations."""
        if int(self._arrived.min()) >= count:
            return
        start = time.monotonic()
        checked = start
        while int(self._arrived.min()) < count:
            now = time.monotonic()
            waited = now - start
            if waited < _SPIN_S:
                os.sched_yield()
                continue
            late = [j for j in range(self.size) if int(self._arrived[j]) < count]
            if waited >= self.timeout_s:
                raise RuntimeError(f"shared-memory collective on group {self.name!r}: rank(s) {late} of the group "
                                   f"did not reach operation {count} within {self.timeout_s:g} s")
            if now - checked >= _LIVENESS_S:
                checked = now
                dead = self._dead(late)
                if dead and int(self._arrived.min()) < count:  # not arrived in the meantime
                    who = ", ".join(f"rank {j} (pid {pid})" for j, pid in dead)
                    raise RuntimeError(f"shared-memory collective on group {self.name!r}: {who} of the group exited "
                                       f"before reaching operation {count}")
            time.sleep(1e-4)


def _process_identity(pid: int) -> tuple[int, int] | None:
    """(pid, start time) of a live process, from /proc; None when there is no such process, or it
    has exited and waits to be reaped (a zombie), or /proc cannot tell."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read().decode("ascii", "replace")
    except OSError:
        return None
    fields = stat[stat.rfind(")") + 2:].split()  # after "pid (comm) ": the comm may hold spaces
    if len(fields) < 20 or fields[0] in ("Z", "X", "x"):
        return None
    return pid, int(fields[19])  # field 22 of proc(5): start time, after pid and comm


# -- set up by ProcessGroups.initialize --------------------------------------------------------------

TRANSPORTS = ("auto", "shm", "torch")


def open_transports(groups: dict, mode: str, slot_bytes: int = SLOT_BYTES,
                    timeout_s: float = 1800.0) -> tuple[dict, dict[str, str]]:
    """Give each group of size > 1 whose ranks share this host a transport: `groups` with
    Group.transport set, and for each group left on torch.distributed, why (one line).

    mode "auto" uses shared memory where it can and where this host has a core for each of its
    ranks (spinning ranks on shared cores would slow each other down); "shm" insists (a
    TransportError saying why it cannot); "torch" never uses it. Collective over the world: every
    rank decides from the same gathered facts, so a group's ranks always agree."""
    import dataclasses
    import socket
    import uuid

    import torch.distributed as dist

    if mode not in TRANSPORTS:
        raise ValueError(f"collective transport must be one of {', '.join(TRANSPORTS)}, got {mode!r}")
    wanted = {name: g for name, g in groups.items() if g.size > 1}
    if mode == "torch":
        return groups, {name: "transport 'torch' chosen" for name in wanted}
    backend = str(dist.get_backend()).lower()
    why_not = supported_here() or (None if "gloo" in backend else f"the process group's backend is {backend}")
    free = 0
    if os.path.isdir(SHM_DIR):
        st = os.statvfs(SHM_DIR)
        free = st.f_bavail * st.f_frsize
    facts = {"host": (socket.gethostname(), *_kernel_and_mounts()), "why_not": why_not,
             "cpus": sorted(os.sched_getaffinity(0)),
             "free": free, "run": uuid.uuid4().hex, "groups": {name: g.ranks for name, g in wanted.items()}}
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, facts)
    me = dist.get_rank()
    run = everyone[0]["run"]
    world_reasons = choose(everyone, mode, slot_bytes)
    if mode == "shm" and world_reasons:  # on every rank alike, so none is left waiting in a barrier
        (name, ranks), why = sorted(world_reasons.items())[0]
        raise TransportError(f"cannot use the shared-memory transport for group {name!r} (ranks {list(ranks)}): "
                             f"{why}")
    reasons = {name: world_reasons[name, g.ranks] for name, g in wanted.items() if (name, g.ranks) in world_reasons}
    chosen = {name: g for name, g in wanted.items() if name not in reasons}
    paths = {name: os.path.join(SHM_DIR, f"specc-{run}-{name}-{'-'.join(map(str, g.ranks))}") for name, g in chosen.items()}
    created, error = [], None
    for name, g in chosen.items():
        if g.ranks[0] == me:  # the group's first rank creates the file
            try:
                fd = os.open(paths[name], os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
                created.append(paths[name])
                try:  # allocated now: a /dev/shm that fills up fails here, not as a SIGBUS mid-step
                    os.posix_fallocate(fd, 0, segment_bytes(g.size, slot_bytes))
                finally:
                    os.close(fd)
            except OSError as e:
                error = f"creating {paths[name]}: {e.strerror or e}"
                break
    transports: dict = {}
    error = _agree(error)  # also: every file exists before anyone maps it
    if error is None:
        try:
            for name, g in chosen.items():
                transports[name] = SharedMemoryTransport(paths[name], g.size, g.rank, name, slot_bytes, timeout_s)
        except (OSError, RuntimeError) as e:
            error = f"mapping the segment of group {name!r}: {e}"
        error = _agree(error)  # also: every member has mapped it, so the names can go
    for transport in transports.values():  # every member has written its process id by now
        transport.see_peers()
    for path in created:  # the memory lives while mapped
        os.unlink(path)
    dist.barrier()  # no rank returns while a name is left in /dev/shm
    if error is not None:  # on every rank alike
        for transport in transports.values():
            transport.close()
        if mode == "shm":
            raise TransportError(f"cannot use the shared-memory transport: {error}")
        reasons.update({name: error for name in chosen})
        chosen = {}
    out = dict(groups)
    out.update({name: dataclasses.replace(g, transport=transports[name]) for name, g in chosen.items()})
    return out, reasons


def _agree(error: str | None) -> str | None:
    """The first rank's error, on every rank (None when no rank had one); a barrier too."""
    import torch.distributed as dist

    errors: list = [None] * dist.get_world_size()
    dist.all_gather_object(errors, error)
    return next((f"rank {r}: {e}" for r, e in enumerate(errors) if e is not None), None)


def choose(everyone: list[dict], mode: str, slot_bytes: int = SLOT_BYTES) -> dict[tuple, str]:
    """Which groups of the world cannot have a transport, and why: (name, ranks) -> one line.

    From every rank's facts (host, why_not, the cores it may run on, free bytes in /dev/shm, and its
    groups as name -> global ranks), so every rank computes the same answer for every group."""
    hosts: dict = {}
    for r, f in enumerate(everyone):
        hosts.setdefault(f["host"], []).append(r)
    groups = sorted({(name, tuple(ranks)) for f in everyone for name, ranks in f["groups"].items()})
    reasons: dict[tuple, str] = {}
    for key in groups:
        members = [everyone[r] for r in key[1]]
        on_host = hosts[members[0]["host"]]
        cores = len(set().union(*(everyone[r]["cpus"] for r in on_host)))  # ranks may be pinned apart
        if any(f["host"] != members[0]["host"] for f in members):
            reasons[key] = "its ranks are on more than one host"
        elif any(f["why_not"] for f in members):
            reasons[key] = next(f["why_not"] for f in members if f["why_not"])
        elif mode == "auto" and len(on_host) > cores:
            reasons[key] = f"{len(on_host)} ranks share {cores} cores on this host (transport 'shm' uses it anyway)"
    for host, on_host in sorted(hosts.items()):
        mapped = [key for key in groups if key not in reasons and everyone[key[1][0]]["host"] == host]
        need = sum(segment_bytes(len(ranks), slot_bytes) for _, ranks in mapped)
        if mapped and need > min(everyone[r]["free"] for r in on_host):
            for key in mapped:
                reasons[key] = f"{SHM_DIR} has less free space than the {need / 2 ** 20:.0f} MiB the segments need"
    return reasons


def _kernel_and_mounts() -> tuple[str, str]:
    """Host names can repeat across machines and containers: the kernel's boot id tells machines
    apart, the mount namespace tells whether two processes see the same /dev/shm."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = ""
    try:
        mounts = os.readlink("/proc/self/ns/mnt")
    except OSError:
        mounts = ""
    return boot, mounts
