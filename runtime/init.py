"""Tensor-parallel-invariant initialization.

Every parameter a runtime layer creates carries `_specc_init`, a ParamInit that
says how to draw the FULL tensor and which slice of it this rank holds. The full
tensor is drawn from a generator seeded by a stable hash of (seed, parameter
name), so TP=4 starts from exactly the TP=1 model.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import torch

from . import mappings
from .parallel_state import Group

_KINDS = ("normal", "ones", "zeros")


@dataclass(frozen=True)
class ParamInit:
    kind: str  # "normal" | "ones" | "zeros"
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

    def __post_init__(self):
        if self.kind not in _KINDS:
            raise ValueError(f"init kind must be one of {_KINDS}, got {self.kind!r}")
        if self.shard_dim is not None:
            if sum(self.segments) != self.full_shape[self.shard_dim]:
                raise ValueError(
                    f"segments {list(self.segments)} do not sum to the full size "
                    f"{self.full_shape[self.shard_dim]} of dim {self.shard_dim}"
                )
            for size in self.segments:
                if size % self.tp_size != 0:
                    raise ValueError(
                        f"segment of size {size} is not divisible by the tensor-parallel size {self.tp_size}"
                    )

    @property
    def local_shape(self) -> tuple[int, ...]:
        shape = list(self.full_shape)
        if self.shard_dim is not None:
            shape[self.shard_dim] //= self.tp_size
        if self.expert_dim is not None:
            shape[self.expert_dim] //= self.ep_size
        return tuple(shape)


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
) -> torch.nn.Parameter:
    """Attach init metadata; full_shape defaults to p's shape (a replicated parameter). An expert
    weight names its expert dim: the full tensor holds every expert, and ep's rank keeps its block."""
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
    return torch.randn(meta.full_shape, generator=generator) * meta.std


def local_slice(full: torch.Tensor, meta: ParamInit) -> torch.Tensor:
    """This rank's shard of a full tensor: its block of experts, then each segment's rank-slice,
    concatenated."""
    if meta.expert_dim is not None:
        full = full.chunk(meta.ep_size, dim=meta.expert_dim)[meta.ep_rank]
    if meta.shard_dim is None:
        return full
    pieces = []
    for segment in full.split(list(meta.segments), dim=meta.shard_dim):
        pieces.append(segment.chunk(meta.tp_size, dim=meta.shard_dim)[meta.tp_rank])
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
            p._specc_init = ParamInit(meta.kind, float(init_std), meta.full_shape, meta.shard_dim, meta.segments,
                                      meta.tp_rank, meta.tp_size)
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
    uniform in [0.5, 1.5], biases (init "zeros") normal around 0.1 with std 0.1, other weights
    normal with their init std (0.02 where that is 0). Drawn from its own stream per name."""
    generator = torch.Generator().manual_seed(stable_seed(seed, "randomized:" + name))
    if meta.kind == "ones":
        return torch.rand(meta.full_shape, generator=generator) + 0.5
    if meta.kind == "zeros":
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
        per_rank = shards.chunk(tp.size, dim=0)
        local_sizes = [size // tp.size for size in meta.segments]
        split = [piece.split(local_sizes, dim=0) for piece in per_rank]
        segments = [torch.cat([split[r][i] for r in range(tp.size)], dim=0) for i in range(len(local_sizes))]
        return torch.cat(segments, dim=0).movedim(0, dim).contiguous()


def full_parameter(p: torch.nn.Parameter, group: Group, ep: Group | None = None) -> torch.Tensor:
    """The full (unsharded) value of a possibly sharded parameter."""
    return gather_full(p, p, group, ep)


def _meta(p: torch.nn.Parameter) -> ParamInit:
    meta = getattr(p, "_specc_init", None)
    if meta is None:
        raise ValueError("parameter has no init metadata (_specc_init)")
    return meta
