"""Optimization passes over a typed graph.

fuse_boundaries   implementations absorb adjacent boundaries they can perform themselves
                  (Megatron fuses the sequence-parallel all-gather into the column GEMM and
                  overlaps the input-gradient all-reduce with the weight-gradient GEMM)
cancel_inverses   a conversion immediately undone (X -> Y -> X) is dropped
"""

from __future__ import annotations

from ..ir.graph import Absorbed, Graph
from ..ops import OPS


def fuse_boundaries(g: Graph) -> None:
    """A boundary read by exactly one op that can perform it (its contract's `absorbable`)
    moves into that op."""
    for op in list(g.iter_ops()):
        if op.kind != "boundary":
            continue
        consumers = g.consumers(op.outputs[0])
        if len(consumers) != 1 or consumers[0] == "<output>":
            continue
        user = consumers[0]
        mode = OPS[user.kind].absorbable(user.attrs).get((op.boundary.src, op.boundary.dst))
        if mode is None or user.inputs[0] != op.outputs[0] or op.outputs[0] in user.inputs[1:]:
            continue
        g.replace_input(user, 0, op.inputs[0])
        user.in_layouts[0] = op.boundary.src
        user.absorbed.append(Absorbed(op.boundary, mode))
        g.remove_op(op.id)


def cancel_inverses(g: Graph) -> None:
    for op in list(g.iter_ops()):
        if op.id not in g.ops or op.kind != "boundary":
            continue
        for user in g.consumers(op.outputs[0]):
            if user == "<output>" or user.kind != "boundary":
                continue
            if user.boundary.dst == op.boundary.src and user.boundary.src == op.boundary.dst:
                for later in g.consumers(user.outputs[0]):
                    if later != "<output>":
                        for i, v in enumerate(later.inputs):
                            if v == user.outputs[0]:
                                g.replace_input(later, i, op.inputs[0])
                g.remove_op(user.id)
        if not g.consumers(op.outputs[0]):
            g.remove_op(op.id)
