"""Expand a validated spec into the op graph: every repeated layer instantiated."""

from __future__ import annotations

from ..errors import SpecError
from ..frontend.model import Leaf, Ref
from ..ops import OPS, Ctx
from .graph import Graph, Op, Value

_INPUT_DTYPES = {"int64": "int64", "int32": "int32", "float32": "float32", "bfloat16": "act", "float16": "act"}


def build_graph(spec) -> Graph:
    g = Graph(spec)
    g.ctx = Ctx.of(spec.settings)
    args = []
    for inp in spec.inputs:
        # model inputs are batch-first, [b, s, ...] (token ids, labels): the sequence is dim 1
        seq_dim = 1 if len(inp.shape) >= 2 else None
        args.append(g.add_value(Value(inp.name, inp.name, inp.shape, _INPUT_DTYPES[inp.dtype], None,
                                      seq_dim=seq_dim)).id)
    g.inputs = list(args)
    g.outputs = _instantiate(g, spec.root, "", args)
    g.set_call("", g.inputs, g.outputs)
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
            g.set_call(sub_scope, args, outs)
            return outs
        g.repeats[sub_scope] = sub.repeat
        first = list(args)
        for i in range(sub.repeat):
            outs = _instantiate(g, sub.module_at(i), f"{sub_scope}.{i}", args)
            g.set_call(f"{sub_scope}.{i}", args, outs)
            args = outs + first[1:]  # the first input is threaded; the others reach every layer
        g.set_call(sub_scope, first, args[:1])
        return args[:1]
    assert isinstance(sub, Leaf)
    return _leaf(g, m, scope, index, e, sub.op, sub.attrs, f"{prefix}{sub.name}", sub.name, args, targets, sub.impl,
                 sub.attr_locs, sub.attr_exprs)


def _leaf(g, m, scope, index, e, kind_name, attrs, base_id, attr_name, args, targets, impl, locs=None,
          exprs=None) -> list:
    kind = OPS[kind_name]
    op_id = g.unique_id(base_id)

    def fail(msg):
        raise SpecError(e.loc, f"{op_id}: {msg}")

    kind.check(attrs, locs or {}, g.ctx)  # size rules first: they name the attribute that breaks them
    attrs = kind.instance_attrs(attrs, _layer_index(g, scope), fail)
    shapes = [g.values[a].shape for a in args]
    out_shapes = kind.out_shapes(attrs, shapes, fail)
    kind.check_inputs(attrs, shapes, g.ctx, fail)
    names = [t if t else f"{(attr_name or kind_name)}_out" for t in targets]
    if len(names) != len(out_shapes):
        names = [f"{attr_name or kind_name}_out{i}" for i in range(len(out_shapes))]
    dtype = kind.out_dtype(attrs)
    seq_dims = kind.out_seq_dims(attrs, [g.values[a].seq_dim for a in args])
    outs = []
    for i, (name, shape) in enumerate(zip(names, out_shapes)):
        vid = f"{op_id}:{i}" if len(out_shapes) > 1 else op_id
        seq_dim = seq_dims[i] if i < len(seq_dims) else 0
        outs.append(g.add_value(Value(vid, name, tuple(shape), dtype, op_id, seq_dim=seq_dim)).id)
    op = Op(op_id, kind_name, dict(attrs), list(args), outs, scope, m.name, attr_name, index, e.loc, impl=impl,
            attr_locs=dict(locs or {}), attr_exprs=dict(exprs or {}))
    g.insert_op(op)
    for follower, follower_attrs in kind.followers(attrs):
        outs = _follower(g, op, m, follower, follower_attrs, outs)
    return outs


def _layer_index(g: Graph, scope: str) -> int | None:
    """The index of the innermost repeated-module instance `scope` lies in (layers.3.mlp -> 3)."""
    parts = scope.split(".") if scope else []
    for n in range(len(parts), 0, -1):
        if ".".join(parts[:n - 1]) in g.repeats and parts[n - 1].isdigit():
            return int(parts[n - 1])
    return None


def _follower(g: Graph, leader: Op, m, kind_name: str, attrs: dict, args: list) -> list:
    """An internal op the leader's contract adds after it (a row-parallel linear's bias, added
    after the reduction of its partial sums); it belongs to the leader's submodule."""
    src = g.values[args[0]]
    op_id = g.unique_id(f"{leader.id}.{attrs.get('name', 'bias')}")
    out = g.add_value(Value(op_id, src.name, src.shape, src.dtype, op_id, seq_dim=src.seq_dim))
    op = Op(op_id, kind_name, {**attrs, "owner_attr": leader.attr_name}, list(args), [out.id], leader.scope, m.name,
            None, leader.step, leader.loc, impl="auto")
    g.insert_op(op)
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
        mine, my_shard = OPS[op.kind].tie_contract(op.attrs)
        theirs = next((w for w in OPS[target.kind].weights(target.attrs) if w.name == "weight"), None)
        if theirs is None or tuple(theirs.shape) != mine:
            raise SpecError(loc, f"{op.id}: cannot tie to '{tie}': its weight is "
                            f"{list(theirs.shape) if theirs else 'missing'}, this one needs {list(mine)}")
        if theirs.shard_dim != my_shard:
            raise SpecError(loc, f"{op.id}: tied weights must be sharded the same way; '{tie}' shards dim {theirs.shard_dim}",
                            "a vocabulary-parallel embedding ties to a column-parallel output layer")
        op.tied_to = target.id
