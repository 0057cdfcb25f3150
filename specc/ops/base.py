"""What the compiler knows about one kind of op: its attributes, shapes, weights, layout contract,
activation memory and how to emit it. Every op kind lives in its own small file in this package."""

from __future__ import annotations

from dataclasses import dataclass, field, fields, replace

from ..errors import Loc, SpecError
from ..layouts import AXES, GROUP_NAMES

TYPES = ("int", "float", "bool", "str", "int_list", "float_list")


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
    expert_dim: int | None = None  # stacked experts: this dim is split over the expert-parallel ranks
    units: tuple = ()  # heads per segment (0: any rows); fewer heads than TP ranks: each replicated


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
    prefer: str | None = None  # the placement its joined inputs should arrive in when its outputs are fixed


@dataclass(frozen=True)
class HFKnob:
    """A Hugging Face config key whose behaviour an op kind models. `requested(config, n)` reads
    what config.json asks of the model's n ops of this kind (a list, one per op in execution
    order), or None when config.json does not say; `modeled(attrs)` is what one op does. `any`:
    one value for the whole model (`requested` gives a list of one: a null in config.json is a
    request too), which every op that has one (a truthy `modeled`) must match, `absent` when no op
    has one (a tied output layer; a soft cap on the logits)."""

    key: str
    requested: object
    modeled: object
    any: bool = False
    absent: object = False


@dataclass
class Ctx:
    """Parallel settings the op rules read, and the mesh axis being typed.

    Layout rules are stated per mesh axis: `rule` dispatches to `rule_tp`, `rule_cp`, ... by
    `axis`, and `placement` values in a rule are that axis's (I, R, S(s), S(h), P)."""

    tp: int
    sp: bool
    home: str  # placement of activations between layers on this axis (tp: S(s) with SP, else I)
    demand: dict = field(default_factory=dict)  # value id -> placement its consumers want
    cp: int = 1
    axis: str = "tp"
    ep: int = 1  # expert-parallel size: not a layout axis (EP ranks are data-parallel ranks)
    in_units: list = field(default_factory=list)  # per input of the op being typed: Value.units

    @property
    def sizes(self) -> dict:
        """The size of every mesh axis (layouts.AXES)."""
        return {axis: getattr(self, axis) for axis in AXES}

    @property
    def size(self) -> int:
        return self.sizes[self.axis]

    @classmethod
    def of(cls, settings) -> "Ctx":
        """The context of a compile's settings, on the tp axis: every field named for a parallel
        group (layouts.GROUP_NAMES) takes that setting's size, so a new group is one field here."""
        sizes = {f.name: getattr(settings, f.name) for f in fields(cls) if f.name in GROUP_NAMES}
        return cls(sp=settings.sp, home="S(s)" if settings.sp else "I", **sizes)

    def on(self, axis: str) -> "Ctx":
        home = ("S(s)" if self.sp else "I") if axis == "tp" else ("S(s)" if self.cp > 1 else "I")
        return replace(self, home=home, axis=axis, demand={}, in_units=[])


class OpKind:
    """Base of all op kinds; subclasses override what differs."""

    name = ""
    doc = ""
    attrs: tuple = ()
    n_inputs: tuple = (1, 1)  # min, max
    # a model input of packed documents this op takes as its last input where the settings ask for it
    # (frontend/packed.py): "position_ids" (--reset-position-ids) or "document_ids" (--reset-attention-mask)
    packed_input: str | None = None
    n_outputs = 1
    impls = ("native",)
    nonlinear = False  # a partial sum must never reach it
    any_cut = False  # works feature by feature on S(h): a shard cut by segments will do (elementwise ops)
    # selective recompute runs this op again in backward, keeping only its inputs: an op whose kept
    # tensors are large next to its FLOPs (the attention core's s x s scores; Korthikanti et al. 2022).
    # Its call must be its submodule applied to its inputs (`self.name(a, b)`), so it can be wrapped.
    selective_recompute = False

    # -- checks and shapes -------------------------------------------------------------
    def check(self, attrs: dict, locs: dict, ctx: Ctx) -> None:
        """Divisibility and consistency rules of the attributes under the parallel settings."""

    def out_shapes(self, attrs: dict, shapes: list, fail) -> list:
        return [shapes[0]]

    def hf_knobs(self) -> tuple:
        """The Hugging Face config keys whose behaviour this op kind models (HFKnob): a checkpoint
        whose config asks for something else is refused on import, whatever the spec lists."""
        return ()

    def instance_attrs(self, attrs: dict, layer: int | None, fail) -> dict:
        """The attributes of one instance, given the index of the innermost repeated module it
        is in (None outside repeats): per-layer attributes are resolved here."""
        return attrs

    def check_inputs(self, attrs: dict, shapes: list, ctx: Ctx, fail) -> None:
        """Rules on the inputs this instance receives under the parallel settings."""

    def weights(self, attrs: dict) -> list:
        return []

    def active_parameters(self, attrs: dict) -> int:
        """The parameters one token's forward multiplies (the summary's "activated"): all of them,
        unless the op routes each token through some of its weights only (MoE experts)."""
        return sum(numel(w.shape) for w in self.weights(attrs))

    def out_dtype(self, attrs: dict) -> str:
        """dtype of the outputs: "act" (the model's activation dtype) unless the op says otherwise."""
        return "act"

    def out_count(self, attrs: dict) -> int:
        return self.n_outputs

    # -- layouts, one rule per mesh axis ---------------------------------------------------
    def rule(self, attrs: dict, ctx: Ctx) -> LayoutRule:
        return getattr(self, f"rule_{ctx.axis}")(attrs, ctx)

    def rule_tp(self, attrs: dict, ctx: Ctx) -> LayoutRule:
        return LayoutRule(allowed=("I", "R", "S(s)", "S(h)"), accepts_reduction=not self.nonlinear)

    def rule_cp(self, attrs: dict, ctx: Ctx) -> LayoutRule:
        """On the context-parallel axis the sequence is sharded outside attention by definition:
        an op works token by token on this rank's chunks unless it says otherwise (an op that
        needs the whole sequence would say allowed=("I",) and get it gathered)."""
        return LayoutRule(allowed=("S(s)",), accepts_reduction=not self.nonlinear)

    def absorbable(self, attrs: dict) -> dict:
        """Boundaries on input 0 this op can perform itself: {(axis, src, dst): runtime input mode}."""
        return {}

    def converts(self) -> bool:
        """True for the boundary op kind: a layout conversion and nothing else."""
        return False

    def partial_grad_weights(self, node, axis: str, placement: str) -> list:
        """Weights whose gradients are partial on `axis` when input 0 arrives with `placement`:
        a replicated weight used on rank-divergent values (R, S(s)) gets a piece of its gradient
        on each rank (Megatron's `sequence_parallel` tag, here derived)."""
        if placement not in ("R", "S(s)"):
            return []
        return [w.name for w in self.weights(node.attrs) if w.shard_dim is None or axis != "tp"]

    # -- what ops do to fused segments and sequence dims -------------------------------------
    def input_segments(self, attrs: dict, shapes: list) -> tuple:
        """How a sharded input's last dim must be cut into segments for this op to be right on
        S(h) (a split cuts on its sections; a gated unit on its halves); () for one slab, or
        any cut where `any_cut` says so."""
        return ()

    def out_segments(self, attrs: dict, in_segments: list) -> tuple:
        """Segments of output 0's last dim (a fused linear makes them; elementwise ops keep them)."""
        return ()

    def out_units(self, attrs: dict, in_units: list, in_segments: list) -> list:
        """Heads per segment of each output (Value.units), from the inputs'. By default output 0
        keeps input 0's where it keeps its segments (ops that work feature by feature: norms,
        rotary, elementwise ops, boundaries); other outputs have none."""
        rest = [()] * (self.out_count(attrs) - 1)
        if not in_units or not in_units[0]:
            return [()] + rest
        probe = ("segments of input 0",)
        kept = self.out_segments(attrs, [probe] + list(in_segments[1:])) is probe
        return [tuple(in_units[0]) if kept else ()] + rest

    def check_units(self, attrs: dict, in_units: list, ctx: Ctx) -> tuple | None:
        """(the attribute to point at, why) when the heads the inputs carry (Value.units) do not
        fit this op at ctx's TP size; None when they do."""
        return None

    def out_seq_dims(self, attrs: dict, in_seq_dims: list) -> list:
        """Which dim of each output is the sequence (activations are sequence-first)."""
        return [in_seq_dims[0] if in_seq_dims else 0] * self.out_count(attrs)

    def impl_unsupported(self, attrs: dict, impl: str) -> str:
        """Why `impl` cannot compute this op with these attributes ("" when it can): resolve then
        refuses it where the spec pinned it, and falls back to native where it was only asked
        for (auto, --backend)."""
        return ""

    def inputs_unsupported(self, n_inputs: int, impl: str) -> str:
        """Why `impl` cannot take this many inputs ("" when it can; an optional input such as
        attention's document ids): resolve treats it as impl_unsupported."""
        return ""

    def choices(self, attrs: dict, settings, shapes=()) -> dict:
        """Implementation choices made at resolve time, as attributes (name_resolved, name_reason);
        `shapes`: the inputs' global shapes."""
        return {}

    def followers(self, attrs: dict) -> list:
        """Internal ops the compiler adds right after this one: [(kind, attrs)]; each gets the
        leader's submodule name as attrs["owner_attr"]."""
        return []

    def tie_contract(self, attrs: dict) -> tuple:
        """(shape, TP shard dim) of the weight a `tie:` shares; ops without `tie` never ask."""
        raise NotImplementedError(f"{self.name} has no tie attribute")

    def shared_weights(self, attrs: dict) -> list:
        """Weights this op trains that another op's submodule holds (a row-parallel bias)."""
        return []

    def owner(self, node) -> str | None:
        """The submodule (attribute name) that holds this op's weights."""
        return node.attr_name

    def note(self, node) -> str:
        """A comment for the generated line, when the op does something a reader should know."""
        return ""

    # -- collectives the implementation issues itself: ([(kind, bytes)], [(kind, bytes)]) ----
    def collectives(self, node, full_in: list, elt: int, mesh) -> tuple:
        return [], []

    # -- time (specc/plan/time.py): where its collectives run, what overlaps, memory traffic ----
    def comm_axis(self, node, collective: str) -> str:
        """The mesh axis (tp, cp, ep) whose group runs one of the collectives `collectives` lists."""
        return "tp"

    def comm_hidden(self, node) -> tuple:
        """(forward, backward): the share of this op's matrix-multiply time during which the
        runtime runs the op's own collectives concurrently (0: they run before or after it; 1:
        beside all of it). Only what the runtime really overlaps."""
        return 0.0, 0.0

    def memory_traffic(self, node, local_in: list, local_out: list, elt: int) -> tuple:
        """(forward, backward) bytes this op's memory-bound kernels read and write on one rank,
        apart from its matrix multiplies (which `flops` times). By default an elementwise kernel:
        forward reads the inputs and writes the outputs; backward reads the outputs' gradients
        and the saved inputs and writes the inputs' gradients, about twice that."""
        forward = (sum(numel(s) for s in local_in) + sum(numel(s) for s in local_out)) * elt
        return forward, 2 * forward

    # -- activation memory: bytes kept for backward on one rank --------------------------
    def saved_bytes(self, node, local_in: list, local_out: list, elt: int) -> list:
        """[(key, bytes)] kept for backward; a key names a tensor, so a tensor two ops keep counts once."""
        return []

    def working_bytes(self, node, local_in: list, local_out: list, elt: int, mesh) -> int:
        """Bytes this op's kernels hold on one rank while it runs (forward or backward, the larger)
        beyond what `saved_bytes` keeps: temporaries that live only inside the op. The plan adds
        the largest such working set to the activations at the peak (specc/plan/build.py). Most
        ops hold nothing worth counting beyond their inputs and outputs, which the ops before and
        after them keep."""
        return 0

    # -- arithmetic: FLOPs of one rank, (forward, backward) ----------------------------------
    def flops(self, node, local_in: list, local_out: list, mesh) -> tuple:
        """(forward, backward) floating-point operations of the matrix multiplies this op runs on
        one rank, a multiply-add counting 2. Only matrix multiplies count, as in MFU's
        definition (PaLM, Megatron): elementwise ops, norms, softmax and lookups run at memory
        speed and are not what the peak measures. An op whose implementation multiplies
        matrices says so here."""
        return 0, 0

    def kernel_flops(self, node, local_in: list, local_out: list, mesh) -> tuple | None:
        """(forward, backward) FLOPs the chosen implementation's kernels run, for the time model,
        where they differ from `flops()`, the model FLOPs that MFU counts (work computed and then
        masked away, a product recomputed in backward); None: they are flops()."""
        return None

    def matmul_kernel(self, node) -> str:
        """Which kind of kernel runs `flops()` of this node (its implementation chosen), for the time model
        (specc/plan/time.py): "gemm", a BLAS matrix multiply, at a profile's GEMM rate;
        "batched_gemm", a batched BLAS multiply of many small per-head matrices (torch.matmul
        over [batch x heads, rows, head_dim]), at that rate times the profile's
        `efficiency.batched_gemm`; or "attention", a fused attention kernel (many small per-head
        products with the softmax between them), at that rate times `efficiency.attention`; or
        "cp_blocks", context parallelism's blocks (runtime/context_parallel.py): batched GEMMs, whose
        memory-bound passes over the scores run at the profile's `efficiency.cp_blocks` share."""
        return "gemm"

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
    cp: int = 1
    tied_expr: str = ""  # the Python expression of the weight a tied op shares
    in_segments: list = field(default_factory=list)  # per input: the segments its S(h) shards are cut by
    in_units: list = field(default_factory=list)  # per input: heads per segment (Value.units)
    expr_of: object = None  # attribute name -> its spec expression as Python over CONFIG, or None

    def attr(self, node, name: str) -> str:
        """Attribute `name` as Python source: the expression of config names the spec wrote for it
        (emit/config_expr.py), else its value."""
        text = self.expr_of(name) if self.expr_of is not None else None
        return text if text is not None else repr(node.attrs[name])


def need_divisible(value: int, by: int, what: str, loc: Loc, hint: str = "", axis: str = "tp") -> None:
    name = GROUP_NAMES[axis]
    if by > 1 and value % by:
        raise SpecError(loc, f"{what}={value} is not divisible by {name} size {by}",
                        hint or f"choose a multiple of {by} or a smaller --{name}-size")


def numel(shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n
