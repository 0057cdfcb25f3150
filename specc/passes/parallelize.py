"""Layout inference and boundary insertion (docs/architecture.md, "Layouts").

Walk the ops in execution order. On each mesh axis, each op's contract says which placements it
needs: fixed ones (a column-parallel GEMM needs R on tp) or a join (elementwise ops bring their
inputs to one common placement, chosen by the least communication, ties broken towards the
placement activations have between layers). Wherever a producer's placement differs from what its
consumer needs, a boundary from the table in specc/layouts.py is inserted. Nothing here knows layer names: the same rules type any
graph, and a graph that typechecks has correct gradients by construction."""

from __future__ import annotations

import dataclasses

from ..errors import SpecError
from ..ir.graph import Graph, Op, Value
from ..layouts import AXIS_NAMES, BOUNDARIES, SH, SS, I, Layout, P, R, conversion_path, has_replicas
from ..ops import OPS, Ctx

PREFERENCE = (SS, I, SH, R)  # after the home placement, which wins ties


def parallelize(g: Graph, settings) -> None:
    """Type every value on every mesh axis and insert the boundaries. Axes are typed one after
    the other at each op (tp, then cp): their rules are independent, so each axis runs the same
    algorithm on its own placements."""
    mesh = settings.mesh()
    g.mesh = mesh
    base = Ctx.of(settings)
    ctxs = {axis: base.on(axis) for axis in mesh.axes}
    for vid in g.inputs:
        g.values[vid].layout = mesh.replicated()
    _propagate_units(g, ctxs["tp"])
    for axis in mesh.active:
        ctxs[axis].demand = _demands(g, ctxs[axis])
    converted = _Conversions(ctxs)
    for op in list(g.iter_ops()):
        if op.id in g.ops:
            _type_op(g, op, ctxs, converted)
    for axis in mesh.active:  # the model returns complete, replicated values
        for vid in list(g.outputs):
            value = g.values[vid]
            if value.layout[axis] == I:
                continue
            if conversion_path(axis, value.layout[axis], I) is None:
                raise SpecError(g.ops[value.producer].loc, f"model output '{value.name}' has layout {value.layout}, "
                                "which cannot be made replicated", "end the model with a value such as the loss")
            done = _insert_path(g, value, axis, I, "", before=None, ctx=ctxs[axis], converted=converted)
            g.outputs = [done if v == vid else v for v in g.outputs]
            g.rebind(vid, done, "")
    _check_shared_weight_uses(g)


def _check_shared_weight_uses(g: Graph) -> None:
    """A weight that several calls share (a submodule called twice) has one gradient, which the
    runtime all-reduces over an axis when a use leaves it partial there. A use on values that
    every rank of that axis holds whole gives every rank all of its gradient, which that all-reduce
    would count once per rank: refused, naming both uses, since no per-use gradient scaling exists."""
    ops = [op for op in g.iter_ops() if op.inputs and not OPS[op.kind].converts()]
    # a weight another op applies (a row-parallel linear's bias, added by its bias op) is that op's use
    applied_elsewhere = {(op.scope, OPS[op.kind].owner(op), w.name) for op in ops
                         for w in OPS[op.kind].shared_weights(op.attrs)}
    uses: dict = {}  # (scope, owner submodule, weight) -> [op]
    for op in ops:
        kind = OPS[op.kind]
        for w in kind.shared_weights(op.attrs) + [w for w in kind.weights(op.attrs)
                                                  if (op.scope, kind.owner(op), w.name) not in applied_elsewhere]:
            uses.setdefault((op.scope, kind.owner(op), w.name), []).append(op)
    for (_, owner, weight), users in uses.items():
        for axis in g.mesh.active:
            partial = [op for op in users if weight in op.partial_grads.get(axis, ())]
            whole = [op for op in users if weight not in op.partial_grads.get(axis, ())]
            if partial and whole:
                first, here = partial[0], whole[0]
                raise SpecError(here.loc, f"'{owner}' is called here on {here.in_layouts[0]} values, where every "
                                f"{axis} rank gets all of its {weight}'s gradient, and at line {first.loc.line} on "
                                f"{first.in_layouts[0]} values, where its {weight} gets a partial gradient that is "
                                f"all-reduced over {axis}: that sum would count this call {g.mesh.size(axis)} times",
                                "give each call its own submodule")


def _propagate_units(g: Graph, ctx: Ctx) -> None:
    """Value.units (heads per segment) of every value, in execution order, before typing: they do
    not depend on layouts, and the rules read them (a per-head norm keeps replicated heads on
    S(h)). Each op then checks that the heads it receives fit the TP size (check_units)."""
    segments = {vid: () for vid in g.inputs}
    for op in g.iter_ops():
        kind = OPS[op.kind]
        in_units = [g.values[v].units for v in op.inputs]
        in_segments = [segments.get(v, ()) for v in op.inputs]
        problem = kind.check_units(op.attrs, in_units, ctx) if ctx.tp > 1 else None
        if problem:
            raise SpecError(op.attr_locs.get(problem[0]) or op.loc, problem[1])
        if op.outputs:
            segments[op.outputs[0]] = tuple(kind.out_segments(op.attrs, in_segments))
        for vid, units in zip(op.outputs, kind.out_units(op.attrs, in_units, in_segments)):
            g.values[vid].units = tuple(units)


def _rule(g: Graph, op: Op, ctx: Ctx):
    """The op's layout rule on ctx's axis, told the heads its inputs carry."""
    return OPS[op.kind].rule(op.attrs, dataclasses.replace(ctx, in_units=[g.values[v].units for v in op.inputs]))


class _Conversions(dict):
    """(value id, axis, placement, scope) -> the converted value's id, so consumers in one module
    share a conversion; also carries every axis's context."""

    def __init__(self, ctxs: dict):
        super().__init__()
        self.ctxs = ctxs


def _type_op(g: Graph, op: Op, ctxs: dict, converted: dict) -> None:
    mesh = g.mesh
    placements_in, placements_out = {}, {}
    for axis in mesh.axes:
        ctx = ctxs[axis]
        if ctx.size == 1:
            placements_in[axis], placements_out[axis] = [I] * len(op.inputs), [I] * len(op.outputs)
            continue
        placements_in[axis], placements_out[axis] = _type_axis(g, op, ctx, converted)
    op.in_layouts = [Layout(mesh, tuple(placements_in[a][i] for a in mesh.axes)) for i in range(len(op.inputs))]
    op.out_layouts = [Layout(mesh, tuple(placements_out[a][i] for a in mesh.axes)) for i in range(len(op.outputs))]
    _set_outputs(g, op, ctxs)
    _check_segments(g, op)
    kind = OPS[op.kind]
    op.partial_grads = {}
    for axis in mesh.active:
        names = kind.partial_grad_weights(op, axis, placements_in[axis][0]) if op.inputs else []
        if names:
            op.partial_grads[axis] = names
    for axis in mesh.active:
        _convert_shared_outputs(g, op, ctxs[axis], converted)


def _type_axis(g: Graph, op: Op, ctx: Ctx, converted: dict):
    """One op's placements on one axis: its inputs converted to what it needs (boundaries
    inserted before it), and the placements of its outputs."""
    axis = ctx.axis
    layouts = [g.values[v].layout[axis] for v in op.inputs]
    rule = _rule(g, op, ctx)
    if rule.partial_ok and _regroup_partial_sums(g, op, layouts, ctx, converted):
        layouts = [g.values[v].layout[axis] for v in op.inputs]
    joined = list(rule.joined_inputs) if rule.joined_inputs is not None else [
        i for i in range(len(layouts)) if not rule.fixed_inputs or rule.fixed_inputs[i] is None]
    # an op with optional inputs states rules for all of them: keep those of the inputs it has
    need = (list(rule.fixed_inputs) if rule.fixed_inputs else [None] * len(layouts))[:len(layouts)]
    target = _join(g, op, rule, [layouts[i] for i in joined], [op.inputs[i] for i in joined], ctx) if joined else None
    for i in joined:
        need[i] = target
    cut = _wanted_cut(g, op, layouts, joined) if SH in need else ()
    for i, want in enumerate(need):
        if layouts[i] != want:
            _convert_input(g, op, i, want, converted, ctx, cut if want == SH else ())
    outs = list(rule.fixed_outputs) if rule.fixed_outputs else [target] * len(op.outputs)
    return need, outs


def _demands(g: Graph, ctx: Ctx) -> dict:
    """For each value, the placement its consumers will want on ctx's axis (a backward pass over
    the graph), so that a join can look one step ahead. A fixed R demand means "home": R is made
    from it by a copy or gather that the consuming GEMM absorbs."""
    demand: dict = {v: I for v in g.outputs}
    partial = _partial_capable(g, ctx)
    for op in g.iter_ops_reversed():
        rule = _rule(g, op, ctx)
        out_demand = demand.get(op.outputs[0], ctx.home) if op.outputs else ctx.home
        merging = rule.partial_ok and sum(v in partial for v in op.inputs) >= 2  # partial sums can meet here
        for i, vid in enumerate(op.inputs):
            fixed = rule.fixed_inputs[i] if rule.fixed_inputs else None
            want = fixed if fixed is not None else (out_demand if out_demand in rule.allowed else ctx.home)
            if fixed is None and rule.prefer is not None:  # its output does not follow its input
                want = rule.prefer
            if (merging and vid in partial) or (out_demand == P and rule.partial_ok and fixed is None):
                want = P
            want = ctx.home if want == R else want
            if vid in demand and demand[vid] != want:
                want = ctx.home  # consumers disagree: keep it where activations live between layers
            demand[vid] = want
    return demand


def _partial_capable(g: Graph, ctx: Ctx) -> set:
    """Values that can stay partial sums: outputs of ops that make P (row-parallel GEMMs), and of
    one-input ops that keep P (a bias added on one rank)."""
    capable: set = set()
    for op in g.iter_ops():
        rule = _rule(g, op, ctx)
        if rule.fixed_outputs and P in rule.fixed_outputs:
            capable.update(v for v, lay in zip(op.outputs, rule.fixed_outputs) if lay == P)
        elif rule.partial_ok and len(op.inputs) == 1 and op.inputs[0] in capable:
            capable.update(op.outputs)
    # a value read twice is reduced once where it is made (_convert_shared_outputs): not partial then
    return {v for v in capable if len(g.consumers(v)) == 1}


def _convert_shared_outputs(g: Graph, op: Op, ctx: Ctx, converted: dict) -> None:
    """A fixed-output op whose value feeds several consumers that all want another placement (the
    embedding's partial sums feeding the first norm and the residual) converts it once, here."""
    axis = ctx.axis
    if _rule(g, op, ctx).fixed_outputs is None:
        return
    for vid in op.outputs:
        value = g.values[vid]
        users = g.users(vid)
        want = ctx.demand.get(vid, ctx.home)
        have = value.layout[axis]
        if len(users) < 2 or want == have or conversion_path(axis, have, want) in (None, []):
            continue
        current = _insert_path(g, value, axis, want, op.scope, before=g.next_op(op), ctx=ctx, converted=converted)
        made = {current}
        walk = g.values[current]
        while walk.producer is not None and walk.id != vid:  # the boundaries just inserted read vid
            made.add(walk.producer)
            walk = g.values[g.ops[walk.producer].inputs[0]]
        g.replace_all_uses_with(vid, current, where=lambda u: u.id not in made)
        g.rebind(vid, current, op.scope)


def _join(g: Graph, op: Op, rule, layouts: list, values: list, ctx: Ctx) -> str:
    kind = OPS[op.kind]
    axis = ctx.axis
    if P in layouts and not rule.accepts_reduction:
        src = g.ops[g.values[values[layouts.index(P)]].producer]
        raise SpecError(op.loc, f"cannot type {op.id}: {kind.name} is not linear, but its input from {src.id} "
                        f"({src.kind}) is a partial sum P",
                        "a row-parallel output must be reduced by an add, norm, dropout or linear first; "
                        "make the producer column-parallel or replicated")
    if len(layouts) > 1 and len(set(layouts)) == 1 and layouts[0] == P and rule.partial_ok:
        return P  # partial sums meet: add them and reduce once, later
    best, best_cost = None, None
    ahead = ctx.demand.get(op.outputs[0], ctx.home) if op.outputs else ctx.home
    for cand in (ctx.home,) + tuple(p for p in PREFERENCE if p != ctx.home) + ((P,) if rule.partial_ok and P in layouts else ()):
        if cand not in rule.allowed and cand != P:
            continue
        if cand == SH and len({_cut(g.values[v]) for v, lay in zip(values, layouts) if lay == SH}) > 1:
            continue  # shards cut on different segments hold different features: they do not line up
        onward = None if rule.fixed_outputs else conversion_path(axis, cand, ahead)
        cost = sum(_cost(b, g.values[values[0]].shape) for b in onward) if onward else 0
        if onward is None and not rule.fixed_outputs:  # the consumers' layout cannot be reached from here
            cost += 100 * _cost(BOUNDARIES[("tp", P, I)], g.values[values[0]].shape)
        for lay, vid in zip(layouts, values):
            path = conversion_path(axis, lay, cand)
            if path is None:
                cost = None
                break
            cost += sum(_cost(b, g.values[vid].shape) for b in path)
        if cost is not None and (best_cost is None or cost < best_cost):
            best, best_cost = cand, cost
    if best is None:
        raise SpecError(op.loc, f"cannot type {op.id}: inputs have layouts {', '.join(layouts)} on {axis} and "
                        f"{kind.name} needs one of {', '.join(rule.allowed)}; no boundary converts between them")
    return best


def _cut(value: Value) -> tuple:
    """How an S(h) shard of `value` is cut: by its segments, or () for one slab."""
    return tuple(value.segments) if len(value.segments) > 1 else ()


def _wanted_cut(g: Graph, op: Op, layouts: list, joined: list) -> tuple:
    """How `op`'s inputs scattered to S(h) must be cut: by the segments the op declares (a split
    on its sections), else as its joined inputs already on S(h) are cut, else as one slab."""
    declared = OPS[op.kind].input_segments(op.attrs, [g.values[v].shape for v in op.inputs])
    if len(declared) > 1:
        return tuple(declared)
    have = {_cut(g.values[op.inputs[i]]) for i in joined if layouts[i] == SH}
    return have.pop() if len(have) == 1 else ()


def _key(vid: str, axis: str, want: str, scope: str, cut: tuple = ()) -> tuple:
    """The conversion cache's key: a value made `want` in `scope` (S(h) cut by segments: per cut)."""
    return (vid, axis, want, scope) + ((cut,) if cut else ())


def _cost(boundary, shape) -> int:
    """Elements moved, counting an all-reduce as twice an all-gather (ring algorithms)."""
    n = 1
    for d in shape:
        n *= d
    weight = {"all_reduce": 2, "all_gather": 1, "reduce_scatter": 1}
    return n * (weight.get(boundary.forward, 0) + weight.get(boundary.backward, 0))


def _regroup_partial_sums(g: Graph, op: Op, layouts: list, ctx: Ctx, converted: dict) -> bool:
    """In `x + a + b` with a and b partial sums, add a and b first: one reduction, not two."""
    partial = [i for i, lay in enumerate(layouts) if lay == P]
    if len(partial) < 2 or len(partial) == len(layouts):
        return False
    src = [op.inputs[i] for i in partial]
    first = g.values[src[0]]
    new_id = g.unique_id(f"{op.id}.partial_sum")
    out = g.add_value(Value(new_id, first.name, first.shape, first.dtype, new_id, seq_dim=first.seq_dim))
    summed = Op(new_id, "add", {}, src, [out.id], op.scope, op.module, None, op.step, op.loc, impl="native",
                impl_reason="merges partial sums before one reduction")
    with g.inserting_before(op.id):
        g.insert_op(summed)
    _type_op(g, summed, converted.ctxs, converted)
    g.set_inputs(op, [v for i, v in enumerate(op.inputs) if i not in partial] + [out.id])
    return True


def _convert_input(g: Graph, op: Op, index: int, want: str, converted: dict, ctx: Ctx, cut: tuple = ()) -> None:
    axis = ctx.axis
    vid = op.inputs[index]
    value = g.values[vid]
    key = _key(vid, axis, want, op.scope, cut)
    if key in converted:  # a conversion already made for another consumer in this module
        g.replace_input(op, index, converted[key])
        return
    have = value.layout[axis]
    if conversion_path(axis, have, want) is None:
        producer = g.ops[value.producer].id if value.producer else value.name
        raise SpecError(op.loc, f"cannot type {op.id}: input '{value.name}' from {producer} has layout {have} on {axis}, "
                        f"but {op.kind} needs {want}; no boundary converts {have} to {want}")
    current = _insert_path(g, value, axis, want, op.scope, before=op.id, ctx=ctx, converted=converted, at=op, cut=cut)
    g.replace_input(op, index, current)


def _insert_path(g: Graph, value: Value, axis: str, want: str, scope: str, before, ctx: Ctx, converted: dict,
                 at: Op = None, cut: tuple = ()) -> str:
    """Insert the boundaries from value's placement on `axis` to `want` before op `before`; the
    last value's id. A gather from S(h) puts a fused value's segments back in order; a scatter to
    S(h) cuts as `cut` says (segment by segment, or () as one slab)."""
    anchor = at or g.ops[value.producer]
    current = value
    label = _local_name(g, value, scope)
    for boundary in conversion_path(axis, value.layout[axis], want):
        if axis == "tp" and SH in (boundary.src, boundary.dst) and has_replicas(current.units, ctx.tp):
            raise SpecError(anchor.loc, f"{anchor.id}: '{value.name}' holds heads replicated over tensor-parallel ranks "
                            f"(heads {list(current.units)} at tp={ctx.tp}), which no boundary gathers or scatters: "
                            f"{boundary.function} would need it {boundary.dst}",
                            "keep such heads in ops that work head by head (rotary, per-head norms, attention), "
                            "or use a TP size that divides the heads")
        tag = f"{boundary.src}->{boundary.dst}" if axis == "tp" else f"{axis}:{boundary.src}->{boundary.dst}"
        bid = g.unique_id(f"{scope + '.' if scope else ''}{label}:{tag}")
        layout_in = current.layout
        step_cut = cut if boundary.dst == SH else _cut(current) if boundary.src == SH else ()
        segments = step_cut if boundary.dst == SH else current.segments
        out = g.add_value(Value(bid, current.name, current.shape, current.dtype, bid, layout_in.with_(axis, boundary.dst),
                                segments, current.seq_dim, current.units))
        # token ids and labels carry no gradient: their boundaries issue nothing in backward
        attrs = {"axis": axis, "src": boundary.src, "dst": boundary.dst, "grad": current.dtype in ("act", "float32")}
        if boundary.seq_dim_kwarg:
            attrs["seq_dim"] = current.seq_dim
        if step_cut:  # each rank's S(h) shard holds a slice of every segment
            attrs["segments"] = step_cut
        b = Op(bid, "boundary", attrs, [current.id], [out.id], scope, g.scopes[scope], None, anchor.step, anchor.loc,
               impl="native", in_layouts=[layout_in], out_layouts=[out.layout])
        with g.inserting_before(before):
            g.insert_op(b)
        _check_divisible(g, b, out, ctx)
        converted[_key(current.id, axis, boundary.dst, scope, step_cut if boundary.dst == SH else ())] = out.id
        current = out
    converted[_key(value.id, axis, want, scope, cut if want == SH else ())] = current.id
    return current.id


def _local_name(g: Graph, value: Value, scope: str) -> str:
    """The name `scope` knows a value by: a child module's result is named by the call's target."""
    for callee in g.calls_binding(value.id):
        outs = g.calls[callee][1]
        if callee and value.id in outs and g.caller_of(callee) == scope and not g.is_instance(callee):
            return g.call_names[callee][outs.index(value.id)]
    return value.name


def _set_outputs(g: Graph, op: Op, ctxs: dict) -> None:
    kind = OPS[op.kind]
    for vid, lay in zip(op.outputs, op.out_layouts):
        value = g.values[vid]
        value.layout = lay
        _check_divisible(g, op, value, ctxs["tp"])
    if op.outputs:
        segments = kind.out_segments(op.attrs, [g.values[v].segments for v in op.inputs])
        g.values[op.outputs[0]].segments = tuple(segments)


def _check_divisible(g: Graph, op: Op, value: Value, ctx: Ctx) -> None:
    lay, tp, cp = value.layout, ctx, ctx
    seq = value.shape[value.seq_dim] if value.seq_dim is not None and value.shape else None
    if cp.cp > 1 and lay["cp"] == SS:
        if seq is None or seq % (2 * cp.cp):
            raise SpecError(op.loc, f"sequence length {seq} of '{value.name}' is not divisible by 2 x "
                            f"{AXIS_NAMES['cp']} size {cp.cp}, into which context parallelism cuts it "
                            "(two load-balanced chunks per rank)",
                            f"choose a seq_length that divides by {2 * cp.cp}, or a smaller --context-parallel-size")
        seq //= cp.cp
    if tp.tp > 1 and lay["tp"] == SS and (seq is None or seq % tp.tp):
        raise SpecError(op.loc, f"sequence length {seq} of '{value.name}' is not divisible by "
                        f"{AXIS_NAMES['tp']} size {tp.tp}, over which sequence parallelism shards it",
                        "choose a seq_length that divides by the TP size, or turn off --sequence-parallel")
    if tp.tp > 1 and lay["tp"] == SH and value.shape[-1] % tp.tp and not has_replicas(value.units, tp.tp):
        raise SpecError(op.loc, f"last dim {value.shape[-1]} of '{value.name}' is not divisible by "
                        f"{AXIS_NAMES['tp']} size {tp.tp}")


def _check_segments(g: Graph, op: Op) -> None:
    """Fused weights are sharded per segment; ops that cut such a value must cut on segments, and
    ops that read an S(h) value as one slab (a row-parallel GEMM, attention heads) must get one."""
    kind = OPS[op.kind]
    for vid, layout in zip(op.inputs, op.in_layouts):
        if layout["tp"] != SH:
            continue
        value = g.values[vid]
        want = kind.input_segments(op.attrs, [g.values[v].shape for v in op.inputs])
        if len(want) > 1 and value.segments != want:
            have = list(value.segments) if value.segments else "one slab"
            raise SpecError(op.loc, f"{op.id}: splits its input into {list(want)}, but the tensor-parallel shards of "
                            f"'{value.name}' are cut as {have}",
                            f"declare segments: {list(want)} on the linear that makes it, so each rank holds a slice of every part")
        if len(want) <= 1 and not kind.any_cut and _cut(value):
            raise SpecError(op.loc, f"{op.id}: {kind.name} reads '{value.name}' sharded over tensor-parallel ranks as one "
                            f"slab of its last dim, but its shards are cut by segments {list(value.segments)}",
                            "split the value into its segments first, or drop segments: from the linear that makes it")
