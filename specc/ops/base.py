"""What the compiler knows about one kind of op: its attributes, shapes, weights, layout contract,
activation memory and how to emit it. Every op kind lives in its own small file in this package."""

from __future__ import annotations

from dataclasses import dataclass, field

from ..errors import Loc, SpecError

TYPES = ("int", "float", "bool", "str", "int_list")


@dataclass(frozen=True)
class Attr:
    """One attribute of an op in a spec (e.g. `in_features` of a linear)."""

    name: str
    type: str
    required: bool = False
    default: object = None
    choices: tuple = ()
    minimum: float | None = None
    doc: str = ""


@dataclass(frozen=True)
class Weight:
    """A parameter of an op: its full (unsharded) shape, init, and how TP shards it."""

    name: str
    shape: tuple
    init: str  # "normal" | "ones" | "zeros"
    shard_dim: int | None = None  # None: replicated
    segments: tuple = ()  # full sizes along shard_dim, each sharded on its own


@dataclass(frozen=True)
class LayoutRule:
    """How an op types its inputs and outputs.

    fixed: the inputs it needs and the outputs it makes, whatever arrives (a parallel GEMM).
    join: inputs are brought to one common layout from `allowed`, outputs take that layout."""

    fixed_inputs: tuple | None = None
    fixed_outputs: tuple | None = None
    allowed: tuple = ()
    accepts_reduction: bool = False  # may a partial sum P be reduced right before it
    partial_ok: bool = False  # P in, P out (a linear op such as add)
    joined_inputs: tuple | None = None  # which inputs take part in the join (default: all)


@dataclass
class Ctx:
    """Parallel settings the op rules read."""

    tp: int
    sp: bool
    home: str  # layout of activations between layers: S(s) with sequence parallelism, else I
    demand: dict = field(default_factory=dict)  # value id -> layout its consumers want


class OpKind:
    """Base of all op kinds; subclasses override what differs."""

    name = ""
    doc = ""
    attrs: tuple = ()
    n_inputs: tuple = (1, 1)  # min, max
    n_outputs = 1
    impls = ("native",)
    nonlinear = False  # a partial sum must never reach it

    # -- checks and shapes -------------------------------------------------------------
    def check(self, attrs: dict, locs: dict, ctx: Ctx) -> None:
        """Divisibility and consistency rules of the attributes under the parallel settings."""

    def out_shapes(self, attrs: dict, shapes: list, fail) -> list:
        return [shapes[0]]

    def weights(self, attrs: dict) -> list:
        return []

    def out_count(self, attrs: dict) -> int:
        return self.n_outputs

    # -- layouts -------------------------------------------------------------------------
    def rule(self, attrs: dict, ctx: Ctx) -> LayoutRule:
        return LayoutRule(allowed=("I", "R", "S(s)", "S(h)"), accepts_reduction=not self.nonlinear)

    def absorbable(self, attrs: dict) -> dict:
        """Boundaries on input 0 this op can perform itself: {(src, dst): runtime input mode}."""
        return {}

    # -- collectives the implementation issues itself: ([(kind, bytes)], [(kind, bytes)]) ----
    def collectives(self, node, full_in: list, elt: int, tp: int):
        return [], []

    # -- activation memory: bytes kept for backward on one rank --------------------------
    def saved_bytes(self, node, local_in: list, local_out: list, elt: int) -> list:
        """[(key, bytes)] kept for backward; a key names a tensor, so a tensor two ops keep counts once."""
        return []

    # -- emission --------------------------------------------------------------------------
    def constructor(self, node, ctx: "EmitCtx") -> str | None:
        """Python expression building the submodule, or None when the op holds no module."""
        return None

    def call(self, node, args: list, ctx: "EmitCtx") -> str:
        raise NotImplementedError


@dataclass
class EmitCtx:
    """What emission needs beyond the node."""

    tp: int = 1


def need_divisible(value: int, by: int, what: str, loc: Loc, hint: str = "") -> None:
    if by > 1 and value % by:
        raise SpecError(loc, f"{what}={value} is not divisible by tensor-model-parallel size {by}",
                        hint or f"choose a multiple of {by} or a smaller --tensor-model-parallel-size")


def numel(shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n
