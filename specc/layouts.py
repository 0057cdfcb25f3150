"""Layouts of values on the device mesh: one placement per named mesh axis (docs/architecture.md).

The mesh has named axes, innermost first: `tp` (tensor parallel) and `cp` (context parallel).
On each axis a value has one placement, which fixes both where its forward data lives and what
its gradient looks like (DTensor's one placement per mesh dimension, plus the gradient):

    I     replicated, gradient complete on every rank
    R     replicated, gradient partial (each rank holds a piece of the sum)
    S(s)  sharded over the sequence dim; on `cp` in load-balanced chunks (rank r holds chunks r
          and 2N-1-r of 2N), gradient likewise
    S(h)  sharded over the last dim (features or heads), gradient likewise
    P     full shape, the true value is the sum over ranks; gradient replicated

On an axis of size 1 every value is I. A Layout holds the placement on every axis of its mesh;
it prints only the axes of size > 1 (one axis: the bare placement, as in plans of a single
axis; replicated everywhere: I).
"""

from __future__ import annotations

from dataclasses import dataclass

# bytes per element of the dtypes a value or weight may have
DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2, "int64": 8, "int32": 4, "float32": 4}

I, R, SS, SH, P = "I", "R", "S(s)", "S(h)", "P"  # noqa: E741 (the design's names)
ALL = (I, R, SS, SH, P)

AXES = ("tp", "cp")  # mesh axes, innermost first (runtime.ProcessGroups' rank order)
# every parallel group whose size a compiled model fixes, in the order build_model checks them, by
# the name Megatron's flag and the errors give its size (--NAME-size; the settings table's flags,
# tests/specc_cli/test_settings_table.py): the mesh axes, then expert and pipeline parallelism
GROUP_NAMES = {"tp": "tensor-model-parallel", "cp": "context-parallel", "ep": "expert-model-parallel",
               "pp": "pipeline-model-parallel"}
AXIS_NAMES = {axis: GROUP_NAMES[axis] for axis in AXES}


@dataclass(frozen=True)
class Mesh:
    """The parallel axes a graph is typed on: (name, size) in AXES order."""

    sizes: tuple  # ((axis, size), ...)

    @classmethod
    def of(cls, **sizes) -> Mesh:
        unknown = sorted(set(sizes) - set(AXES))
        if unknown:
            raise ValueError(f"unknown mesh axes {unknown}")
        return cls(tuple((a, int(sizes.get(a, 1))) for a in AXES))

    def size(self, axis: str) -> int:
        return dict(self.sizes)[axis]

    @property
    def axes(self) -> tuple:
        return tuple(a for a, _ in self.sizes)

    @property
    def active(self) -> tuple:
        """Axes of size > 1: the only ones where a value can be anything but I."""
        return tuple(a for a, n in self.sizes if n > 1)

    def replicated(self) -> Layout:
        return Layout(self, tuple(I for _ in self.sizes))


@dataclass(frozen=True)
class Layout:
    mesh: Mesh
    placements: tuple  # one per mesh axis, in mesh order

    def __getitem__(self, axis: str) -> str:
        return self.placements[self.mesh.axes.index(axis)]

    def with_(self, axis: str, placement: str) -> Layout:
        i = self.mesh.axes.index(axis)
        return Layout(self.mesh, self.placements[:i] + (placement,) + self.placements[i + 1:])

    def __str__(self) -> str:
        active = self.mesh.active
        if len(active) <= 1:
            return self[active[0]] if active else I
        if all(self[a] == I for a in active):
            return I
        return "/".join(f"{a}:{self[a]}" for a in active)


def local_shape(shape: tuple, layout: Layout) -> tuple:
    """The shape one rank holds of a value of full `shape`. S(s) shards dim 0 (activations are
    sequence-first); use local_shape_dims for values whose sequence is another dim."""
    return local_shape_dims(shape, layout, 0)


def local_shape_dims(shape: tuple, layout: Layout, seq_dim: int | None, segments: tuple = (),
                     units: tuple = ()) -> tuple:
    """`segments`, `units`: the last dim's segments and their heads (Value.units), for S(h) on tp."""
    out = list(shape)
    if not out:
        return tuple(out)
    for axis in layout.mesh.active:
        n = layout.mesh.size(axis)
        placement = layout[axis]
        if placement == SS and seq_dim is not None:
            out[seq_dim] //= n
        elif placement == SH:
            out[-1] = sh_local_size(out[-1], n, segments, units) if axis == "tp" else out[-1] // n
    return tuple(out)


def replicas(units: int, t: int) -> int:
    """How many of t TP ranks hold each of a segment's `units` heads: t // units when there are
    fewer heads than ranks (each head replicated, vLLM's num_kv_head_replicas), else 1."""
    return t // units if units and units < t else 1


def sh_local_size(size: int, t: int, segments: tuple = (), units: tuple = ()) -> int:
    """The part of a last dim of `size` (cut by `segments`, each of `units` heads, 0 where
    unknown) that one of t ranks holds on S(h): a segment of fewer heads than ranks, one head."""
    segs = tuple(segments) or (size,)
    if len(units) != len(segs):
        return size // t
    return sum(s // u if replicas(u, t) > 1 else s // t for s, u in zip(segs, units))


def has_replicas(units: tuple, t: int) -> bool:
    return any(replicas(u, t) > 1 for u in units)


@dataclass(frozen=True)
class Boundary:
    """One conversion between placements on one mesh axis, with Megatron's name and its
    collectives. `function` is the runtime.mappings function the generated code calls."""

    axis: str
    src: str
    dst: str
    function: str
    forward: str  # collective in forward ("" for none, "split" is local)
    backward: str
    kwargs: str = ""  # extra keyword arguments in the generated call
    seq_dim_kwarg: bool = False  # the call names the value's sequence dim (`dim=`)

    @property
    def label(self) -> str:
        return f"{self.src} -> {self.dst}" if self.axis == "tp" else f"{self.axis}:{self.src} -> {self.axis}:{self.dst}"


def _tp(src, dst, function, forward, backward, kwargs=""):
    return ("tp", src, dst), Boundary("tp", src, dst, function, forward, backward, kwargs)


def _cp(src, dst, function, forward, backward, seq=False):
    return ("cp", src, dst), Boundary("cp", src, dst, function, forward, backward, "", seq)


# The boundary table, keyed by (axis, from, to). Missing pairs go through I (two boundaries) or
# cannot be built. The cp conversions of the sequence know the load-balanced chunk order.
BOUNDARIES = dict([
    _tp(I, R, "copy_to_tensor_model_parallel_region", "", "all_reduce"),
    _tp(P, I, "reduce_from_tensor_model_parallel_region", "all_reduce", ""),
    _tp(SS, R, "gather_from_sequence_parallel_region", "all_gather", "reduce_scatter"),
    _tp(SS, I, "gather_from_sequence_parallel_region", "all_gather", "split", "tensor_parallel_output_grad=False"),
    _tp(P, SS, "reduce_scatter_to_sequence_parallel_region", "reduce_scatter", "all_gather"),
    _tp(I, SS, "scatter_to_sequence_parallel_region", "split", "all_gather"),
    _tp(SH, I, "gather_from_tensor_model_parallel_region", "all_gather", "split"),
    _tp(I, SH, "scatter_to_tensor_model_parallel_region", "split", "all_gather"),
    _cp(I, SS, "scatter_to_context_parallel_region", "split", "all_gather", seq=True),
    _cp(SS, I, "gather_from_context_parallel_region", "all_gather", "split", seq=True),
])

# The collectives the plan counts, by the names runtime.comm records them under (runtime.comm.KINDS;
# tests/test_shared_rules.py checks the two agree).
COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter", "send", "recv", "all_to_all")


def cp_chunk_pair(n: int, rank: int) -> tuple[int, int]:
    """The two of the sequence's 2n chunks that CP rank `rank` holds on S(s), in its local order:
    r and 2n-1-r (load balancing for causal attention). The compiler's one statement of the rule;
    runtime.sharding.chunk_pair is checked against it by tests/test_shared_rules.py."""
    return rank, 2 * n - 1 - rank


def conversion_path(axis: str, src: str, dst: str) -> list[Boundary] | None:
    """The boundaries that turn src into dst on `axis`: direct, or through I; None if no sound
    path exists.

    R's gradient is partial and nothing we can compute locally turns a complete gradient back into
    a partial one, so R converts to nothing; and nothing converts into P."""
    if src == dst:
        return []
    if (axis, src, dst) in BOUNDARIES:
        return [BOUNDARIES[(axis, src, dst)]]
    if (axis, src, I) in BOUNDARIES and (axis, I, dst) in BOUNDARIES:
        return [BOUNDARIES[(axis, src, I)], BOUNDARIES[(axis, I, dst)]]
    return None
