"""Optimization passes over a typed graph.

fuse_boundaries   implementations absorb adjacent boundaries they can perform themselves
                  (Megatron fuses the sequence-parallel all-gather into the column GEMM and
                  overlaps the input-gradient all-reduce with the weight-gradient GEMM)
cancel_inverses   a conversion immediately undone (X -> Y -> X on one axis) is dropped
"""

from __future__ import annotations

from ..ir.graph import Absorbed, Graph
from ..ops import OPS


def _is_conversion(op) -> bool:
    return OPS[op.kind].converts()


def fuse_boundaries(g: Graph) -> None:
    """A boundary read by exactly one op that can perform it (its contract's `absorbable`)
    moves into that op. A submodule called at several places is one module with one constructor:
    it absorbs only where every call site absorbs the same boundary the same way."""
    sites: dict = {}  # (scope, submodule) -> its ops
    for op in g.iter_ops():
        if op.attr_name:
            sites.setdefault((op.scope, op.attr_name), []).append(op.id)
    candidates: dict = {}  # user op id -> (boundary op, boundary, mode)
    for op in g.iter_ops():
        if not _is_conversion(op):
            continue
        consumers = g.consumers(op.outputs[0])
        if len(consumers) != 1 or isinstance(consumers[0], str):
            continue
        user = consumers[0]
        b = OPS[op.kind].boundary(op)
        mode = OPS[user.kind].absorbable(user.attrs).get((b.axis, b.src, b.dst))
        if mode is None or user.inputs[0] != op.outputs[0] or op.outputs[0] in user.inputs[1:]:
            continue
        candidates[user.id] = (op, b, mode)
    for user_id, (op, b, mode) in candidates.items():
        user = g.ops[user_id]
        calls = sites.get((user.scope, user.attr_name), [user_id])
        if any(c not in candidates or candidates[c][1:] != (b, mode) for c in calls):
            continue  # another call of this submodule takes its input as it is: keep the boundary
        g.replace_input(user, 0, op.inputs[0])
        user.in_layouts[0] = op.in_layouts[0]
        user.absorbed.append(Absorbed(b, mode))
        g.erase_op(op.id)


def cancel_inverses(g: Graph) -> None:
    for op in list(g.iter_ops()):
        if op.id not in g.ops or not _is_conversion(op):
            continue
        for user in g.users(op.outputs[0]):
            if not _is_conversion(user):
                continue
            if OPS[user.kind].undoes(user, op) and user.outputs[0] not in g.outputs:
                g.replace_all_uses_with(user.outputs[0], op.inputs[0])
                g.erase_op(user.id)
        if not g.consumers(op.outputs[0]):
            g.erase_op(op.id)
