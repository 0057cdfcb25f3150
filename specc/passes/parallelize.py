"""Layout inference and boundary insertion (DESIGN.md, "Layouts and boundaries").

Walk the ops in execution order. Each op's contract says which layouts it needs: fixed ones (a
column-parallel GEMM needs R) or a join (elementwise ops bring their inputs to one common
layout, chosen by the least communication, ties broken towards the layout activations have
between layers). Wherever a producer's layout differs from what its consumer needs, a boundary
from the design's table is inserted. Nothing here knows layer names: the same rules type any
graph, and a graph that typechecks has correct gradients by construction."""

from __future__ import annotations

from ..errors import SpecError
from ..ir.graph import Graph, Op, Value
from ..layouts import BOUNDARIES, SH, SS, I, P, R, conversion_path
from ..ops import OPS, Ctx

PREFERENCE = (SS, I, SH, R)  # after the home layout, which wins ties


def parallelize(g: Graph, settings) -> None:
    ctx = Ctx(tp=settings.tp, sp=settings.sp, home=SS if settings.sp else I)
    for vid in g.inputs:
        g.values[vid].layout = I
    ctx.demand = _demands(g, ctx)
    converted: dict = {}
    for op_id in list(g.order):
        if op_id in g.ops:
            _type_op(g, g.ops[op_id], ctx, converted)
    for vid in list(g.outputs):  # the model returns complete, replicated values
        value = g.values[vid]
        if value.layout == I:
            continue
        if conversion_path(value.layout, I) is None:
            raise SpecError(g.ops[value.producer].loc, f"model output '{value.name}' has layout {value.layout}, "
                            "which cannot be made replicated", "end the model with a value such as the loss")
        done = _insert_path(g, value, I, "", before=None, ctx=ctx, converted=converted)
        g.outputs = [done if v == vid else v for v in g.outputs]
        g.rebind(vid, done, "")


def _type_op(g: Graph, op: Op, ctx: Ctx, converted: dict) -> None:
    kind = OPS[op.kind]
    layouts = [g.values[v].layout for v in op.inputs]
    if ctx.tp == 1:
        op.in_layouts, op.out_layouts = [I] * len(layouts), [I] * len(op.outputs)
        _set_outputs(g, op, ctx)
        return
    rule = kind.rule(op.attrs, ctx)
    if rule.partial_ok and _regroup_partial_sums(g, op, layouts, ctx, converted):
        layouts = [g.values[v].layout for v in op.inputs]
    joined = list(rule.joined_inputs) if rule.joined_inputs is not None else [
        i for i in range(len(layouts)) if not rule.fixed_inputs or rule.fixed_inputs[i] is None]
    need = list(rule.fixed_inputs) if rule.fixed_inputs else [None] * len(layouts)
    target = _join(g, op, rule, [layouts[i] for i in joined], [op.inputs[i] for i in joined], ctx) if joined else None
    for i in joined:
        need[i] = target
    for i, want in enumerate(need):
        if layouts[i] != want:
            _convert_input(g, op, i, want, converted, ctx)
    op.in_layouts = need
    op.out_layouts = list(rule.fixed_outputs) if rule.fixed_outputs else [target] * len(op.outputs)
    _set_outputs(g, op, ctx)
    _check_segments(g, op)
    _mark_partial_grads(op)
    _convert_shared_outputs(g, op, ctx, converted)


def _demands(g: Graph, ctx: Ctx) -> dict:
    """For each value, the layout its consumers will want (a backward pass over the graph), so
    that a join can look one step ahead. A fixed R demand means "home": R is made from it by a
    copy or gather that the consuming GEMM absorbs."""
    demand: dict = {v: I for v in g.outputs}
    partial = _partial_capable(g, ctx)
    for op in reversed([g.ops[i] for i in g.order]):
        if ctx.tp == 1:
            break
        rule = OPS[op.kind].rule(op.attrs, ctx)
        out_demand = demand.get(op.outputs[0], ctx.home) if op.outputs else ctx.home
        merging = rule.partial_ok and sum(v in partial for v in op.inputs) >= 2  # partial sums can meet here
        for i, vid in enumerate(op.inputs):
            fixed = rule.fixed_inputs[i] if rule.fixed_inputs else None
            want = fixed if fixed is not None else (out_demand if out_demand in rule.allowed else ctx.home)
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
        rule = OPS[op.kind].rule(op.attrs, ctx)
        if rule.fixed_outputs and P in rule.fixed_outputs:
            capable.update(v for v, lay in zip(op.outputs, rule.fixed_outputs) if lay == P)
        elif rule.partial_ok and len(op.inputs) == 1 and op.inputs[0] in capable:
            capable.update(op.outputs)
    # a value read twice is reduced once where it is made (_convert_shared_outputs): not partial then
    return {v for v in capable if len(g.consumers(v)) == 1}


def _convert_shared_outputs(g: Graph, op: Op, ctx: Ctx, converted: dict) -> None:
    """A fixed-output op whose value feeds several consumers that all want another layout (the
    embedding's partial sums feeding the first norm and the residual) converts it once, here."""
    if OPS[op.kind].rule(op.attrs, ctx).fixed_outputs is None:
        return
    for vid in op.outputs:
        value = g.values[vid]
        users = [u for u in g.consumers(vid) if u != "<output>"]
        want = ctx.demand.get(vid, ctx.home)
        if len(users) < 2 or want == value.layout or conversion_path(value.layout, want) in (None, []):
            continue
        current = _insert_path(g, value, want, op.scope, before=_next_op(g, op), ctx=ctx, converted=converted)
        for user in users:
            for i, v in enumerate(user.inputs):
                if v == vid:
                    g.replace_input(user, i, current)
        g.rebind(vid, current, op.scope)


def _next_op(g: Graph, op: Op) -> str | None:
    i = g.order.index(op.id)
    return g.order[i + 1] if i + 1 < len(g.order) else None


def _join(g: Graph, op: Op, rule, layouts: list, values: list, ctx: Ctx) -> str:
    kind = OPS[op.kind]
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
        onward = None if rule.fixed_outputs else conversion_path(cand, ahead)
        cost = sum(_cost(b, g.values[values[0]].shape) for b in onward) if onward else 0
        if onward is None and not rule.fixed_outputs:  # the consumers' layout cannot be reached from here
            cost += 100 * _cost(BOUNDARIES[(P, I)], g.values[values[0]].shape)
        for lay, vid in zip(layouts, values):
            path = conversion_path(lay, cand)
            if path is None:
                cost = None
                break
            cost += sum(_cost(b, g.values[vid].shape) for b in path)
        if cost is not None and (best_cost is None or cost < best_cost):
            best, best_cost = cand, cost
    if best is None:
        raise SpecError(op.loc, f"cannot type {op.id}: inputs have layouts {', '.join(layouts)} and "
                        f"{kind.name} needs one of {', '.join(rule.allowed)}; no boundary converts between them")
    return best


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
    out = g.add_value(Value(new_id, first.name, first.shape, first.dtype, new_id))
    summed = Op(new_id, "add", {}, src, [out.id], op.scope, op.module, None, op.step, op.loc, impl="native",
                impl_reason="merges partial sums before one reduction")
    g.add_op(summed, before=op.id)
    _type_op(g, summed, ctx, converted)
    keep = [v for i, v in enumerate(op.inputs) if i not in partial]
    for v in src:
        if g.nx.has_edge(g.values[v].producer, op.id):
            g.nx.remove_edge(g.values[v].producer, op.id)
    op.inputs = keep
    for v in keep:
        g._link(v, op.id)
    op.inputs.append(out.id)
    g._link(out.id, op.id)
    return True


def _convert_input(g: Graph, op: Op, index: int, want: str, converted: dict, ctx: Ctx) -> None:
    vid = op.inputs[index]
    value = g.values[vid]
    key = (vid, want, op.scope)
    if key in converted:  # a conversion already made for another consumer in this module
        g.replace_input(op, index, converted[key])
        return
    if conversion_path(value.layout, want) is None:
        producer = g.ops[value.producer].id if value.producer else value.name
        raise SpecError(op.loc, f"cannot type {op.id}: input '{value.name}' from {producer} has layout {value.layout}, "
                        f"but {op.kind} needs {want}; no boundary converts {value.layout} to {want}")
    current = _insert_path(g, value, want, op.scope, before=op.id, ctx=ctx, converted=converted, at=op)
    g.replace_input(op, index, current)


def _insert_path(g: Graph, value: Value, want: str, scope: str, before, ctx: Ctx, converted: dict, at: Op = None) -> str:
    """Insert the boundaries from value's layout to `want` before op `before`; the last value's id."""
    anchor = at or g.ops[value.producer]
    current = value
    label = _local_name(g, value, scope)
    for boundary in conversion_path(value.layout, want):
        bid = g.unique_id(f"{scope + '.' if scope else ''}{label}:{boundary.src}->{boundary.dst}")
        out = g.add_value(Value(bid, current.name, current.shape, current.dtype, bid, boundary.dst, current.segments))
        b = Op(bid, "boundary", {}, [current.id], [out.id], scope, g.scopes[scope], None, anchor.step, anchor.loc,
               impl="native", boundary=boundary, in_layouts=[boundary.src], out_layouts=[boundary.dst])
        g.add_op(b, before=before)
        _check_divisible(g, b, out, ctx)
        converted[(current.id, boundary.dst, scope)] = out.id
        current = out
    converted[(value.id, want, scope)] = current.id
    return current.id


def _local_name(g: Graph, value: Value, scope: str) -> str:
    """The name `scope` knows a value by: a child module's result is named by the call's target."""
    for callee, (_, outs) in g.calls.items():
        if callee and value.id in outs and g.caller_of(callee) == scope and not _is_instance(g, callee):
            return g.call_names[callee][outs.index(value.id)]
    return value.name


def _is_instance(g: Graph, scope: str) -> bool:
    """One instance of a repeated module (`layers.3`); its results are named at the group call."""
    return "." in scope and scope.rsplit(".", 1)[0] in g.repeats


def _set_outputs(g: Graph, op: Op, ctx: Ctx) -> None:
    for vid, lay in zip(op.outputs, op.out_layouts):
        value = g.values[vid]
        value.layout = lay
        _check_divisible(g, op, value, ctx)
    if op.kind == "linear" and op.attrs.get("segments") and len(op.attrs["segments"]) > 1:
        g.values[op.outputs[0]].segments = tuple(op.attrs["segments"])
    elif op.kind in ("gelu", "silu", "dropout", "rotary") and op.inputs:
        g.values[op.outputs[0]].segments = g.values[op.inputs[0]].segments
    if op.kind == "split":
        t = ctx.tp if op.in_layouts and op.in_layouts[0] == SH else 1
        op.local_sections = [s // t for s in op.attrs["sections"]]


def _check_divisible(g: Graph, op: Op, value: Value, ctx: Ctx) -> None:
    if value.layout == SS and value.shape[0] % ctx.tp:
        raise SpecError(op.loc, f"sequence length {value.shape[0]} of '{value.name}' is not divisible by "
                        f"tensor-model-parallel size {ctx.tp}, over which sequence parallelism shards it",
                        "choose a seq_length that divides by the TP size, or turn off --sequence-parallel")
    if value.layout == SH and value.shape[-1] % ctx.tp:
        raise SpecError(op.loc, f"last dim {value.shape[-1]} of '{value.name}' is not divisible by tensor-model-parallel "
                        f"size {ctx.tp}")


def _check_segments(g: Graph, op: Op) -> None:
    """Fused weights are sharded per segment; ops that cut such a value must cut on segments."""
    if not op.in_layouts or op.in_layouts[0] != SH:
        return
    value = g.values[op.inputs[0]]
    if op.kind == "split":
        want = tuple(op.attrs["sections"])
    elif op.kind == "swiglu":
        half = value.shape[-1] // 2
        want = (half, half)
    else:
        return
    if len(want) > 1 and value.segments != want:
        have = list(value.segments) if value.segments else "one slab"
        raise SpecError(op.loc, f"{op.id}: splits its input into {list(want)}, but the tensor-parallel shards of "
                        f"'{value.name}' are cut as {have}",
                        f"declare segments: {list(want)} on the linear that makes it, so each rank holds a slice of every part")


def _mark_partial_grads(op: Op) -> None:
    """Replicated weights used on rank-divergent inputs (R or S(s)) get partial gradients that
    need a tensor-parallel all-reduce: Megatron's `sequence_parallel` tag, here derived."""
    if op.kind == "bias_add" and op.in_layouts and op.in_layouts[0] == P:
        op.partial_grad = ["bias"]  # added on one rank: the others' gradient is zero until the all-reduce
        return
    if not op.in_layouts or op.in_layouts[0] not in (R, SS):
        return
    if op.kind == "bias_add":
        op.partial_grad = ["bias"]
        return
    kind = OPS[op.kind]
    op.partial_grad = [w.name for w in kind.weights(op.attrs) if w.shard_dim is None]
