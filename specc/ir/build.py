"""Expand a validated spec into the op graph: every repeated layer instantiated."""

from __future__ import annotations

from ..errors import SpecError
from ..frontend.model import Leaf, Ref
from ..ops import OPS, Ctx
from .graph import Graph, Op, Value

_INPUT_DTYPES = {"int64": "int64", "int32": "int32", "float32": "float32", "bfloat16": "act", "float16": "act"}


def build_graph(spec) -> Graph:
    g = Graph(spec)
    s = spec.settings
    g.ctx = Ctx(tp=s.tp, sp=s.sp, home="S(s)" if s.sp else "I")
    args = []
    for inp in spec.inputs:
        args.append(g.add_value(Value(inp.name, inp.name, inp.shape, _INPUT_DTYPES[inp.dtype], None)).id)
    g.inputs = list(args)
    g.outputs = _instantiate(g, spec.root, "", args)
    g.calls[""] = (list(g.inputs), list(g.outputs))
    _resolve_ties(g)
    return g


def _instantiate(g: Graph, module_name: str, scope: str, args: list) -> list:
    m = g.spec.modules[module_name]
    g.scopes[scope] = module_name
    env = dict(zip(m.inputs, args))
    for index, step in enumerate(m.steps):
        if step.expr is None:
            return [env[n] for n in step.returns]
        results = _eval(g, m, scope, index, step.expr, env, step.targets)
        for name, vid in zip(step.targets, results):
            env[name] = vid
    raise AssertionError("validated modules end with return")


def _eval(g: Graph, m, scope: str, index: int, e, env: dict, targets: list) -> list:
    if e.kind == "var":
        return [env[e.name]]
    args = []
    for a in e.args:
        args.extend(_eval(g, m, scope, index, a, env, [None]))
    prefix = f"{scope}." if scope else ""
    if e.kind in ("add", "mul"):
        return _leaf(g, m, scope, index, e, e.kind, {}, f"{prefix}{e.kind}", None, args, targets, "auto")
    sub = m.submodules[e.name]
    if isinstance(sub, Ref):
        sub_scope = f"{prefix}{sub.name}"
        g.call_names[sub_scope] = [t or f"{sub.name}_out" for t in targets]
        if sub.repeat is None:
            outs = _instantiate(g, sub.module, sub_scope, args)
            g.calls[sub_scope] = (list(args), list(outs))
            return outs
        g.repeats[sub_scope] = sub.repeat
        first = list(args)
        for i in range(sub.repeat):
            outs = _instantiate(g, sub.module, f"{sub_scope}.{i}", args)
            g.calls[f"{sub_scope}.{i}"] = (list(args), list(outs))
            args = outs
        g.calls[sub_scope] = (first, list(args))
        return args
    assert isinstance(sub, Leaf)
    return _leaf(g, m, scope, index, e, sub.op, sub.attrs, f"{prefix}{sub.name}", sub.name, args, targets, sub.impl,
                 sub.attr_locs)


def _leaf(g, m, scope, index, e, kind_name, attrs, base_id, attr_name, args, targets, impl, locs=None) -> list:
    kind = OPS[kind_name]
    op_id = g.unique_id(base_id)

    def fail(msg):
        raise SpecError(e.loc, f"{op_id}: {msg}")

    kind.check(attrs, locs or {}, g.ctx)  # size rules first: they name the attribute that breaks them
    shapes = [g.values[a].shape for a in args]
    out_shapes = kind.out_shapes(attrs, shapes, fail)
    names = [t if t else f"{(attr_name or kind_name)}_out" for t in targets]
    if len(names) != len(out_shapes):
        names = [f"{attr_name or kind_name}_out{i}" for i in range(len(out_shapes))]
    dtype = "float32" if kind_name == "cross_entropy" else "act"
    outs = []
    for i, (name, shape) in enumerate(zip(names, out_shapes)):
        vid = f"{op_id}:{i}" if len(out_shapes) > 1 else op_id
        outs.append(g.add_value(Value(vid, name, tuple(shape), dtype, op_id)).id)
    op = Op(op_id, kind_name, dict(attrs), list(args), outs, scope, m.name, attr_name, index, e.loc, impl=impl,
            attr_locs=dict(locs or {}))
    g.add_op(op)
    if kind_name == "linear" and attrs.get("parallel") == "row" and attrs.get("bias"):
        outs = _row_bias(g, op, m)
    return outs


def _row_bias(g: Graph, linear: Op, m) -> list:
    """A row-parallel linear's bias is added after the reduction of its partial sums."""
    src = g.values[linear.outputs[0]]
    bias_id = f"{linear.id}.bias"
    out = g.add_value(Value(bias_id, src.name, src.shape, "act", bias_id))
    op = Op(bias_id, "bias_add", {"size": linear.attrs["out_features"], "owner_attr": linear.attr_name}, [src.id],
            [out.id], linear.scope, m.name, None, linear.step, linear.loc, impl="auto")
    g.add_op(op)
    return [out.id]


def _resolve_ties(g: Graph) -> None:
    """`tie: embedding` shares the weight of a sibling op; shapes and sharding must agree."""
    for op in list(g.iter_ops()):
        tie = op.attrs.get("tie")
        if not tie:
            continue
        loc = op.attr_locs.get("tie", op.loc)
        target_id = f"{op.scope}.{tie}" if op.scope else tie
        target = g.ops.get(target_id)
        if target is None:
            raise SpecError(loc, f"{op.id}: tie target '{tie}' is not an op in the same module",
                            "name a sibling submodule that has a 'weight', e.g. tie: embedding")
        mine = (op.attrs["out_features"], op.attrs["in_features"])
        theirs = next((w for w in OPS[target.kind].weights(target.attrs) if w.name == "weight"), None)
        if theirs is None or tuple(theirs.shape) != mine:
            raise SpecError(loc, f"{op.id}: cannot tie to '{tie}': its weight is "
                            f"{list(theirs.shape) if theirs else 'missing'}, this one needs {list(mine)}")
        if theirs.shard_dim != (0 if op.attrs["parallel"] == "column" else None if op.attrs["parallel"] == "none" else 1):
            raise SpecError(loc, f"{op.id}: tied weights must be sharded the same way; '{tie}' shards dim {theirs.shard_dim}",
                            "a vocabulary-parallel embedding ties to a column-parallel output layer")
        op.tied_to = target.id
