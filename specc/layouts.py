"""Layout types of values on a tensor-parallel group (DESIGN.md, "Layouts and boundaries").

A layout fixes both where a value's forward data lives and what its gradient looks like:

    I     replicated, gradient complete on every rank
    R     replicated, gradient partial (each rank holds a piece of the sum)
    S(s)  rank r holds rows r*s/t.. of dim 0 (the sequence), gradient likewise
    S(h)  rank r holds a slice of the last dim (features or heads), gradient likewise
    P     full shape, the true value is the sum over ranks; gradient replicated
"""

from __future__ import annotations

from dataclasses import dataclass

I, R, SS, SH, P = "I", "R", "S(s)", "S(h)", "P"  # noqa: E741 (the design's names)
ALL = (I, R, SS, SH, P)


def local_shape(shape: tuple, layout: str, tp: int) -> tuple:
    """The shape one rank holds of a value of full `shape` in `layout`."""
    if tp == 1 or not shape:
        return tuple(shape)
    if layout == SS:
        return (shape[0] // tp,) + tuple(shape[1:])
    if layout == SH:
        return tuple(shape[:-1]) + (shape[-1] // tp,)
    return tuple(shape)


@dataclass(frozen=True)
class Boundary:
    """One conversion between layouts, with Megatron's name and its collectives."""

    src: str
    dst: str
    function: str  # runtime.mappings function name
    forward: str  # collective in forward ("" for none, "split" is local)
    backward: str
    kwargs: str = ""  # extra keyword arguments in the generated call

    @property
    def label(self) -> str:
        return f"{self.src} -> {self.dst}"


# The design's boundary table. Missing pairs go through I (two boundaries) or cannot be built.
BOUNDARIES = {
    (I, R): Boundary(I, R, "copy_to_tensor_model_parallel_region", "", "all_reduce"),
    (P, I): Boundary(P, I, "reduce_from_tensor_model_parallel_region", "all_reduce", ""),
    (SS, R): Boundary(SS, R, "gather_from_sequence_parallel_region", "all_gather", "reduce_scatter"),
    (SS, I): Boundary(SS, I, "gather_from_sequence_parallel_region", "all_gather", "split",
                      "tensor_parallel_output_grad=False"),
    (P, SS): Boundary(P, SS, "reduce_scatter_to_sequence_parallel_region", "reduce_scatter", "all_gather"),
    (I, SS): Boundary(I, SS, "scatter_to_sequence_parallel_region", "split", "all_gather"),
    (SH, I): Boundary(SH, I, "gather_from_tensor_model_parallel_region", "all_gather", "split"),
    (I, SH): Boundary(I, SH, "scatter_to_tensor_model_parallel_region", "split", "all_gather"),
}

COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter")


def conversion_path(src: str, dst: str) -> list[Boundary] | None:
    """The boundaries that turn src into dst: direct, or through I; None if no sound path exists.

    R's gradient is partial and nothing we can compute locally turns a complete gradient back into
    a partial one, so R converts to nothing; and nothing converts into P."""
    if src == dst:
        return []
    if (src, dst) in BOUNDARIES:
        return [BOUNDARIES[(src, dst)]]
    if (src, I) in BOUNDARIES and (I, dst) in BOUNDARIES:
        return [BOUNDARIES[(src, I)], BOUNDARIES[(I, dst)]]
    return None
