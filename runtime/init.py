"""Tensor-parallel-invariant initialization.

Every parameter a runtime layer creates carries `_specc_init`, a ParamInit that
says how to draw the FULL tensor and which slice of it this rank holds. The full
tensor is drawn from a generator seeded by a stable hash of (seed, parameter
name), so TP=4 starts from exactly the TP=1 model.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass, replace

import torch

from . import mappings
from .parallel_state import Group

# ssm_a_log, ssm_dt_bias: the Mamba-2 mixer's per-head A_log and dt_bias, drawn as Megatron does
_KINDS = ("normal", "ones", "zeros", "ssm_a_log", "ssm_dt_bias")


@dataclass(frozen=True)
class ParamInit:
    kind: str  # one of _KINDS
    std: float
    full_shape: tuple[int, ...]
    shard_dim: int | None  # None: replicated
    segments: tuple[int, ...]  # full sizes along shard_dim, each sharded on its own
    tp_rank: int
    tp_size: int
    # expert parallelism: the experts (dim expert_dim) split in contiguous blocks over the ep ranks
    expert_dim: int | None = None
    ep_rank: int = 0
    ep_size: int = 1
    # per segment, how many indivisible units (attention heads) it holds, 0 where it does not say:
    # a segment of fewer units than TP ranks has each unit replicated (segment_piece)
    units: tuple[int, ...] = ()

    def __post_init__(self):
        if self.kind not in _KINDS:
            raise ValueError(f"init kind must be one of {_KINDS}, got {self.kind!r}")
        if self.shard_dim is not None:
            if sum(self.segments) != self.full_shape[self.shard_dim]:
                raise ValueError(
                    f"segments {list(self.segments)} do not sum to the full size "
                    f"{self.full_shape[self.shard_dim]} of dim {self.shard_dim}"
                )
            if self.units and len(self.units) != len(self.segments):
                raise ValueError(f"units {list(self.units)} name {len(self.units)} segments, "
                                 f"the parameter has {len(self.segments)}")
            if any(self.units) and self.shard_dim != 0:
                raise ValueError("replicated units are rows: they need shard_dim 0")
            for size, units in zip(self.segments, self.units or (0,) * len(self.segments)):
                check_segment(size, units, self.tp_size)
        elif self.units:
            raise ValueError("units apply to a sharded parameter (shard_dim)")

    def pieces(self) -> list:
        """Per segment along shard_dim: (local start, full start, length, replicas) of the rows
        this rank holds; replicas > 1 where the segment's units are replicated over ranks."""
        out, local, full = [], 0, 0
        for size, units in zip(self.segments, self.units or (0,) * len(self.segments)):
            start, n = segment_piece(size, units, self.tp_rank, self.tp_size)
            out.append((local, full + start, n, unit_replicas(units, self.tp_size)))
            local += n
            full += size
        return out

    def replicated_units(self) -> bool:
        """Does this rank hold a replica of some unit (rows other TP ranks hold too)?"""
        return self.shard_dim is not None and any(unit_replicas(u, self.tp_size) > 1 for u in self.units)

    def duplicate_rows(self) -> list:
        """(local start, length) of the rows this rank holds as a replica other than the unit's
        first (the gradient norm counts each unit once, on its first replica)."""
        return [(local, n) for local, _, n, reps in self.pieces() if reps > 1 and self.tp_rank % reps]

    @property
    def local_shape(self) -> tuple[int, ...]:
        shape = list(self.full_shape)
        if self.shard_dim is not None:
            shape[self.shard_dim] = sum(n for _, _, n, _ in self.pieces())
        if self.expert_dim is not None:
            shape[self.expert_dim] //= self.ep_size
        return tuple(shape)


def check_segment(size: int, units: int, tp_size: int) -> None:
    """A segment of `size` rows made of `units` indivisible units (0: any rows) can be sharded
    over tp_size ranks: whole units per rank (units % tp_size == 0), or each unit replicated
    (tp_size % units == 0)."""
    if units:
        if size % units:
            raise ValueError(f"segment of size {size} is not a whole number of its {units} units")
        if units % tp_size and tp_size % units:
            raise ValueError(f"segment of {units} units is neither divisible by the tensor-parallel size "
                             f"{tp_size} nor divides it")
    elif size % tp_size:
        raise ValueError(f"segment of size {size} is not divisible by the tensor-parallel size {tp_size}")


def segment_piece(size: int, units: int, rank: int, tp_size: int) -> tuple[int, int]:
    """(start, length) of the rows of one segment that TP rank `rank` holds. A segment of fewer
    units (attention heads) than ranks has each unit replicated over tp_size // units
    consecutive ranks: rank r holds unit r // (tp_size // units) (vLLM's KV-head replication);
    otherwise it is cut into tp_size equal pieces (whole units where it has units)."""
    if units and units < tp_size:
        n = size // units
        return rank // (tp_size // units) * n, n
    n = size // tp_size
    return rank * n, n


def unit_replicas(units: int, tp_size: int) -> int:
    """How many TP ranks hold each unit of a segment of `units` units (1: none replicated)."""
    return tp_size // units if units and units < tp_size else 1


def tag_parameter(
    p: torch.nn.Parameter,
    kind: str,
    *,
    tp: Group | None = None,
    std: float = 0.0,
    full_shape=None,
    shard_dim: int | None = None,
    segments=None,
    ep: Group | None = None,
    expert_dim: int | None = None,
    units=None,
) -> torch.nn.Parameter:
    """Attach init metadata; full_shape defaults to p's shape (a replicated parameter). An expert
    weight names its expert dim: the full tensor holds every expert, and ep's rank keeps its block.
    `units`: per segment, its number of indivisible units (heads), replicated when fewer than TP ranks."""
    tp = tp or Group.single("tp")
    ep = ep or Group.single("ep")
    full_shape = tuple(full_shape if full_shape is not None else p.shape)
    if shard_dim is not None and segments is None:
        segments = (full_shape[shard_dim],)
    meta = ParamInit(
        kind=kind,
        std=float(std),
        full_shape=full_shape,
        shard_dim=shard_dim,
        segments=tuple(segments or ()),
        tp_rank=tp.rank if shard_dim is not None else 0,
        tp_size=tp.size if shard_dim is not None else 1,
        expert_dim=expert_dim,
        ep_rank=ep.rank if expert_dim is not None else 0,
        ep_size=ep.size if expert_dim is not None else 1,
        units=tuple(int(u) for u in units) if units else (),
    )
    if expert_dim is not None and full_shape[expert_dim] % ep.size:
        raise ValueError(f"{full_shape[expert_dim]} experts are not divisible by the expert-parallel size {ep.size}")
    if meta.local_shape != tuple(p.shape):
        raise ValueError(f"parameter shape {tuple(p.shape)} does not match its local shape {meta.local_shape}")
    p._specc_init = meta
    return p


def stable_seed(seed: int, name: str) -> int:
    """A 63-bit seed from (seed, name) that is the same on every machine and run
    (Python's hash() is salted per process)."""
    digest = hashlib.sha256(f"{int(seed)}:{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def full_init_tensor(meta: ParamInit, seed: int, name: str) -> torch.Tensor:
    """The full fp32 tensor a parameter starts from, identical at every TP size."""
    if meta.kind == "ones":
        return torch.ones(meta.full_shape)
    if meta.kind == "zeros":
        return torch.zeros(meta.full_shape)
    generator = torch.Generator().manual_seed(stable_seed(seed, name))
    if meta.kind == "ssm_a_log":  # A uniform in [1, 16], kept as log A (A = -exp(A_log))
        return torch.log(torch.rand(meta.full_shape, generator=generator) * 15 + 1)
    if meta.kind == "ssm_dt_bias":  # softplus^-1 of dt log-uniform in [0.001, 0.1], at least 1e-4
        low, high = math.log(1e-3), math.log(1e-1)
        dt = torch.exp(torch.rand(meta.full_shape, generator=generator) * (high - low) + low).clamp(min=1e-4)
        return dt + torch.log(-torch.expm1(-dt))
    return torch.randn(meta.full_shape, generator=generator) * meta.std


def local_slice(full: torch.Tensor, meta: ParamInit) -> torch.Tensor:
    """This rank's shard of a full tensor: its block of experts, then each segment's rank-slice,
    concatenated."""
    if meta.expert_dim is not None:
        full = full.chunk(meta.ep_size, dim=meta.expert_dim)[meta.ep_rank]
    if meta.shard_dim is None:
        return full
    pieces = [full.narrow(meta.shard_dim, start, n) for _, start, n, _ in meta.pieces()]
    return torch.cat(pieces, dim=meta.shard_dim)


TIED_NAME = "_specc_tied_name"  # a weight tied across pipeline stages: the name both ends share
TIED_COPY = "_specc_tied_copy"  # ... on the stage that holds the copy (the output layer's end)


def tie_across_stages(p: torch.nn.Parameter, name: str, *, copy: bool = False,
                      init_std: float | None = None) -> torch.nn.Parameter:
    """A weight shared by the first and the last pipeline stage (the word embedding and the output
    layer), held as one Parameter on each: both are drawn, saved and loaded under `name` (the
    owner's), their gradients are summed over the embedding group (finalize_model_grads), and the
    copy is counted once in the gradient norm. `init_std`: the owner's, so the copy starts equal."""
    setattr(p, TIED_NAME, name)
    if copy:
        setattr(p, TIED_COPY, True)
        meta = getattr(p, "_specc_init", None)
        if meta is not None and init_std is not None:
            p._specc_init = replace(meta, std=float(init_std))
    return p


def tied_name(p: torch.nn.Parameter) -> str | None:
    return getattr(p, TIED_NAME, None)


def is_tied_copy(p: torch.nn.Parameter) -> bool:
    return getattr(p, TIED_COPY, False)


def init_name(name: str, p: torch.nn.Parameter) -> str:
    """The name a parameter is drawn, saved and loaded under: its own, or for a weight tied across
    pipeline stages the owner's (so PP > 1 starts from, and checkpoints, the PP = 1 model)."""
    return getattr(p, TIED_NAME, name)


def init_parameters(model: torch.nn.Module, seed: int) -> None:
    """Fill every parameter of `model` with this rank's slice of its full init tensor.

    Names come from model.named_parameters(), which lists a shared (tied) parameter
    once, under its first name, so it is drawn once.
    """
    with torch.no_grad():
        for name, p in model.named_parameters():
            meta = getattr(p, "_specc_init", None)
            if meta is None:
                raise ValueError(
                    f"parameter {name!r} has no init metadata (_specc_init); create it with a "
                    f"runtime layer or tag it with runtime.init.tag_parameter"
                )
            p.copy_(local_slice(full_init_tensor(meta, seed, init_name(name, p)), meta))


def randomized_full_tensor(meta: ParamInit, seed: int, name: str) -> torch.Tensor:
    """A full tensor far from the initial one, identical at every TP size: gains (init "ones")
    uniform in [0.5, 1.5], biases (init "zeros") and the Mamba-2 A_log and dt_bias normal around
    0.1 with std 0.1, other weights normal with their init std (0.02 where that is 0). Drawn from its own stream per name."""
    generator = torch.Generator().manual_seed(stable_seed(seed, "randomized:" + name))
    if meta.kind == "ones":
        return torch.rand(meta.full_shape, generator=generator) + 0.5
    if meta.kind in ("zeros", "ssm_a_log", "ssm_dt_bias"):
        return torch.randn(meta.full_shape, generator=generator) * 0.1 + 0.1
    return torch.randn(meta.full_shape, generator=generator) * (meta.std or 0.02)


def randomize_parameters(model: torch.nn.Module, seed: int) -> None:
    """Replace every parameter with this rank's slice of randomized_full_tensor: non-trivial
    weights (no zero biases, no unit gains) that are still the same model at every TP size, so a
    bias or gain handled wrongly across ranks shows (from the initial weights it cannot)."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            meta = _meta(p)
            p.copy_(local_slice(randomized_full_tensor(meta, seed, init_name(name, p)), meta).to(p.dtype))


def gather_full(tensor: torch.Tensor, p: torch.nn.Parameter, tp: Group, ep: Group | None = None) -> torch.Tensor:
    """All-gather `tensor` (p itself, or p.grad) from its shards to p's full shape (an expert
    weight also over the expert-parallel group `ep`)."""
    meta = _meta(p)
    if meta.expert_dim is not None and meta.ep_size > 1:
        if ep is None or ep.size != meta.ep_size:
            raise ValueError(f"expert parameter was split over {meta.ep_size} expert-parallel ranks; pass that group")
        with torch.no_grad():
            local = _gather_tp(tensor, meta, tp).movedim(meta.expert_dim, 0).contiguous()
            return mappings.gather_dim0(local, ep).movedim(0, meta.expert_dim).contiguous()
    return _gather_tp(tensor, meta, tp)


def _gather_tp(tensor: torch.Tensor, meta: ParamInit, tp: Group) -> torch.Tensor:
    if meta.shard_dim is None:
        return tensor.detach().clone()
    if meta.tp_size != tp.size:
        raise ValueError(f"parameter was sharded over {meta.tp_size} ranks, but the group has {tp.size}")
    dim = meta.shard_dim
    with torch.no_grad():
        # Gather along dim 0 (what the collective concatenates): [t * local, ...].
        shards = mappings.gather_dim0(tensor.detach().movedim(dim, 0).contiguous(), tp)
        per_rank = [piece.split(_local_sizes(meta), dim=0) for piece in shards.chunk(tp.size, dim=0)]
        # a replicated unit is taken from its first replica (replica_mismatch compares the others)
        segments = [torch.cat([per_rank[r][i] for r in range(0, tp.size, reps)], dim=0)
                    for i, (_, _, _, reps) in enumerate(meta.pieces())]
        return torch.cat(segments, dim=0).movedim(0, dim).contiguous()


def _local_sizes(meta: ParamInit) -> list:
    return [n for _, _, n, _ in meta.pieces()]


def replica_mismatch(tensor: torch.Tensor, p: torch.nn.Parameter, tp: Group) -> float:
    """The largest difference between two TP ranks' copies of a replicated unit of `tensor` (p
    itself, or p.grad): 0 where p has none. Collective over tp (every rank calls it)."""
    meta = _meta(p)
    if not meta.replicated_units() or tp.size == 1:
        return 0.0
    with torch.no_grad():
        shards = mappings.gather_dim0(tensor.detach().movedim(meta.shard_dim, 0).contiguous(), tp)
        per_rank = [piece.split(_local_sizes(meta), dim=0) for piece in shards.chunk(tp.size, dim=0)]
        worst = 0.0
        for i, (_, _, _, reps) in enumerate(meta.pieces()):
            for r in range(tp.size):
                if reps > 1 and r % reps:
                    first = per_rank[r - r % reps][i]
                    worst = max(worst, float((per_rank[r][i].float() - first.float()).abs().max()))
        return worst


def full_parameter(p: torch.nn.Parameter, group: Group, ep: Group | None = None) -> torch.Tensor:
    """The full (unsharded) value of a possibly sharded parameter."""
    return gather_full(p, p, group, ep)


def _meta(p: torch.nn.Parameter) -> ParamInit:
    meta = getattr(p, "_specc_init", None)
    if meta is None:
        raise ValueError("parameter has no init metadata (_specc_init)")
    return meta
