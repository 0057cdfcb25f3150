"""Process groups, held in one object that is passed explicitly (no module globals).

Rank order follows Megatron: tensor-parallel ranks are innermost (adjacent global
ranks, which share a node's fast links), then context, then data, then pipeline:

    global_rank = tp_r + tp * (cp_r + cp * (dp_r + dp * pp_r))

Expert parallelism reuses the data-parallel ranks, as in Megatron: an expert-parallel group of
size ep is carved out of each data-parallel group (dp ranks dp_r with the same dp_r // ep), and
the ranks that hold the same experts form the expert-data-parallel group (dp_r % ep fixed, size
dp / ep), over which the expert parameters' gradients are reduced.
"""

from __future__ import annotations

import datetime
import itertools
from dataclasses import dataclass, field
from typing import Any

import torch.distributed as dist

from .cpu.shared_memory import open_transports

# Axis order from innermost to outermost; it fixes the rank layout above.
_AXES = ("tp", "cp", "dp", "pp")


@dataclass(frozen=True)
class Group:
    """One parallel axis as seen by this rank.

    `group` is None when size == 1: every collective on such a group is a no-op,
    so single-process runs need no torch.distributed at all. Issue collectives
    through runtime.comm, never torch.distributed directly: there group=None
    would mean the whole world.
    """

    size: int
    rank: int
    group: Any
    ranks: tuple[int, ...]
    name: str
    # a SharedMemoryTransport when the group's ranks share a host (runtime/cpu/shared_memory.py):
    # runtime.comm then moves CPU tensors through it instead of torch.distributed
    transport: Any = field(default=None, compare=False, repr=False)

    @classmethod
    def single(cls, name: str) -> Group:
        return cls(size=1, rank=0, group=None, ranks=(0,), name=name)


@dataclass
class ProcessGroups:
    tp: Group
    cp: Group
    dp: Group
    pp: Group
    world_size: int
    rank: int
    ep: Group = field(default_factory=lambda: Group.single("ep"))  # expert-parallel (within dp)
    edp: Group = field(default_factory=lambda: Group.single("edp"))  # expert-data-parallel
    # Megatron's embedding group: the first and the last pipeline stage of one (tp, cp, dp) position,
    # which sum the gradients of the weight they share (a tied word embedding / output layer)
    embd: Group = field(default_factory=lambda: Group.single("embd"))
    # Groups this object created with dist.new_group, destroyed by destroy().
    _created: list = field(default_factory=list, repr=False, compare=False)
    # group name -> why it has no shared-memory transport (runtime/cpu/shared_memory.open_transports)
    transport_reasons: dict = field(default_factory=dict, repr=False, compare=False)

    @classmethod
    def single(cls) -> ProcessGroups:
        return cls(
            tp=Group.single("tp"),
            cp=Group.single("cp"),
            dp=Group.single("dp"),
            pp=Group.single("pp"),
            world_size=1,
            rank=0,
        )

    @classmethod
    def initialize(cls, tp: int = 1, cp: int = 1, pp: int = 1, dp: int | None = None, ep: int = 1,
                   transport: str = "auto", timeout_minutes: float | None = None) -> ProcessGroups:
        """Build every group of the (tp, cp, dp, pp) grid; collective over the world.

        Every rank calls dist.new_group for every group (of size > 1) in the same
        order, as torch.distributed requires, and keeps the ones it belongs to.
        Size-1 axes get no process group: their collectives are no-ops.
        `transport` ("auto", "shm", "torch") says which groups move CPU tensors through
        shared memory instead of torch.distributed (runtime/cpu/shared_memory.py).
        `timeout_minutes`: how long a collective of these groups waits for its peers (Megatron's
        --distributed-timeout-minutes; None: torch's default, 30 minutes).
        """
        if not (dist.is_available() and dist.is_initialized()):
            raise RuntimeError(
                "ProcessGroups.initialize needs torch.distributed to be initialized "
                "(call torch.distributed.init_process_group first), or use ProcessGroups.single()"
            )
        world, rank = dist.get_world_size(), dist.get_rank()
        timeout = datetime.timedelta(minutes=timeout_minutes) if timeout_minutes is not None else None
        sizes = _axis_sizes(world, tp=tp, cp=cp, pp=pp, dp=dp)
        coords = _coords(rank, sizes)
        if not isinstance(ep, int) or ep < 1 or sizes["dp"] % ep:
            raise ValueError(f"expert-model-parallel size {ep!r} must divide the data-parallel size {sizes['dp']} "
                             f"(expert parallelism is carved out of the data-parallel ranks)")
        groups: dict[str, Group] = {}
        created = []
        for axis in _AXES:
            for ranks in _axis_rank_lists(axis, sizes):
                handle = dist.new_group(list(ranks), timeout=timeout) if sizes[axis] > 1 else None
                if handle is not None:
                    created.append(handle)
                if rank in ranks:
                    groups[axis] = Group(
                        size=sizes[axis], rank=coords[axis], group=handle, ranks=ranks, name=axis
                    )
        for name, size in (("ep", ep), ("edp", sizes["dp"] // ep)):
            for dp_ranks in _expert_dp_rank_lists(sizes["dp"], ep, name):
                for ranks in _axis_rank_lists("dp", sizes):
                    ranks = tuple(ranks[d] for d in dp_ranks)
                    handle = dist.new_group(list(ranks), timeout=timeout) if size > 1 else None
                    if handle is not None:
                        created.append(handle)
                    if rank in ranks:
                        groups[name] = Group(size=size, rank=ranks.index(rank), group=handle, ranks=ranks, name=name)
        if sizes["pp"] > 1:
            for ranks in _axis_rank_lists("pp", sizes):
                ends = (ranks[0], ranks[-1])
                handle = dist.new_group(list(ends), timeout=timeout)
                created.append(handle)
                if rank in ends:
                    groups["embd"] = Group(size=2, rank=ends.index(rank), group=handle, ranks=ends, name="embd")
        try:
            groups, reasons = open_transports(groups, transport, **({"timeout_s": 60.0 * timeout_minutes}
                                                                    if timeout_minutes is not None else {}))
        except BaseException:  # the groups made above would otherwise outlive the error
            for handle in created:
                dist.destroy_process_group(handle)
            raise
        return cls(**groups, world_size=world, rank=rank, _created=created, transport_reasons=reasons)

    def transport_summary(self) -> str:
        """One line: which groups move CPU tensors through shared memory, which through
        torch.distributed, and why."""
        groups = [self.tp, self.cp, self.dp, self.pp, self.ep, self.edp, self.embd]
        shm = [g.name for g in groups if g.size > 1 and g.transport is not None]
        other = [f"{g.name} ({self.transport_reasons.get(g.name, 'no transport opened')})"
                 for g in groups if g.size > 1 and g.transport is None]
        if not shm and not other:
            return "collectives: none (every group has one rank)"
        parts = ([f"{', '.join(shm)} through shared memory"] if shm else []) + \
            ([f"{', '.join(other)} through torch.distributed"] if other else [])
        return "collectives on CPU tensors: " + "; ".join(parts)

    def destroy(self) -> None:
        """Destroy the groups initialize() created and close their shared-memory transports; safe
        to call twice."""
        for g in (self.tp, self.cp, self.dp, self.pp, self.ep, self.edp, self.embd):
            if g.transport is not None:
                g.transport.close()
        while self._created:
            dist.destroy_process_group(self._created.pop())


def _expert_dp_rank_lists(dp: int, ep: int, name: str) -> list:
    """Positions within a data-parallel group of each expert-parallel group (consecutive dp ranks)
    or each expert-data-parallel group (dp ranks ep apart)."""
    if name == "ep":
        return [tuple(j * ep + i for i in range(ep)) for j in range(dp // ep)]
    return [tuple(i + j * ep for j in range(dp // ep)) for i in range(ep)]


def _axis_sizes(world: int, *, tp: int, cp: int, pp: int, dp: int | None) -> dict[str, int]:
    for name, value in (("tp", tp), ("cp", cp), ("pp", pp)):
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} size must be a positive integer, got {value!r}")
    model = tp * cp * pp
    if dp is None:
        if world % model != 0:
            raise ValueError(
                f"world size {world} is not divisible by tp*cp*pp = {tp}*{cp}*{pp} = {model}"
            )
        dp = world // model
    elif not isinstance(dp, int) or dp < 1:
        raise ValueError(f"dp size must be a positive integer, got {dp!r}")
    if model * dp != world:
        raise ValueError(
            f"tp*cp*dp*pp = {tp}*{cp}*{dp}*{pp} = {model * dp} does not equal the world size {world}"
        )
    return {"tp": tp, "cp": cp, "dp": dp, "pp": pp}


def _coords(rank: int, sizes: dict[str, int]) -> dict[str, int]:
    coords = {}
    for axis in _AXES:
        coords[axis] = rank % sizes[axis]
        rank //= sizes[axis]
    return coords


def _global_rank(coords: dict[str, int], sizes: dict[str, int]) -> int:
    rank = 0
    for axis in reversed(_AXES):
        rank = rank * sizes[axis] + coords[axis]
    return rank


def _axis_rank_lists(axis: str, sizes: dict[str, int]) -> list[tuple[int, ...]]:
    """All groups along `axis`: one per combination of the other axes' coordinates,
    in a deterministic order (every rank must create groups in the same order)."""
    others = [a for a in _AXES if a != axis]
    result = []
    for values in itertools.product(*(range(sizes[a]) for a in reversed(others))):
        fixed = dict(zip(reversed(others), values))
        ranks = tuple(_global_rank({**fixed, axis: i}, sizes) for i in range(sizes[axis]))
        result.append(ranks)
    return sorted(result)
