"""From a typed op graph to the Plan: one entry per op, repeated layers folded, step totals."""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from .. import __version__
from ..layouts import COLLECTIVES, DTYPE_BYTES, I, replicas, sh_local_size
from ..ops import OPS
from ..ops.base import numel

OPT_BYTES = {"fp32": 8, "bf16": 12, "fp16": 12}  # Adam m, v (+ fp32 master weights in 16-bit training)


@dataclass
class Entry:
    name: str  # op id, with a repeated scope written layers.*
    kind: str
    impl: str
    impl_reason: str
    layouts_in: list
    layouts_out: list
    forward: list  # [(collective, bytes)]
    backward: list
    saved: int  # activation bytes kept for backward
    notes: list = field(default_factory=list)
    count: int = 1
    flops: tuple = (0, 0)  # (forward, backward) matrix-multiply FLOPs on one rank, one instance
    weights: tuple = ()  # ((name, shape on one rank), ...) of the weights the op owns
    # for the time model (specc/plan/time.py): the mesh axis of each forward and backward
    # collective, the share of the op's GEMM time its collectives run beside (forward, backward),
    # the bytes its memory-bound kernels move (forward, backward), and whether backward runs the
    # forward again (recompute: then backward's first len(forward) collectives are the forward's)
    comm_axes: tuple = ((), ())
    comm_hidden: tuple = (0.0, 0.0)
    memory: tuple = (0, 0)
    recomputed: bool = False
    kernel: str = "gemm"  # what runs the FLOPs (OpKind.matmul_kernel): "gemm", "batched_gemm", "attention", "cp_blocks"
    kernel_flops: tuple = ()  # the FLOPs the kernels run where not `flops` (OpKind.kernel_flops); (): flops


@dataclass
class Plan:
    spec_name: str
    spec_path: str
    spec_hash: str
    settings: object
    entries: list
    groups: dict  # folded scope pattern -> instance count
    totals: dict
    version: str = __version__


def build_plan(graph) -> Plan:
    return assemble_plan(graph, plan_entries(graph), graph.spec.settings)


def plan_entries(graph) -> list:
    """One entry per op (unfolded), recompute applied: what does not depend on the pipeline cut."""
    elt = DTYPE_BYTES[graph.spec.settings.dtype]
    raw = [_entry(graph, op, elt) for op in graph.iter_ops()]
    _recompute(graph, raw)
    return raw


def assemble_plan(graph, raw: list, settings, unpipelined: Plan | None = None) -> Plan:
    """The Plan of `raw` (plan_entries) under `settings` and graph.pipeline. The layout search
    (specc/plan/search.py) calls it once per pipeline cut of one compiled graph: the passes
    before the cut do not read the pipeline settings. `unpipelined`, the same entries' plan at
    PP 1, lends its folded entries and totals: only the pipeline's part is new (unless layers of
    several modules fold by module, which happens at PP 1 only)."""
    spec = graph.spec
    if unpipelined is not None and graph.pipeline is not None and not any("{" in g for g in unpipelined.groups):
        totals = {**unpipelined.totals, "pipeline": _pipeline_totals(graph, raw, settings)}
        return Plan(spec.name, spec.path, spec.source_hash, settings, unpipelined.entries, unpipelined.groups, totals)
    entries, groups = _fold(graph, raw)
    totals = _totals(graph, raw, DTYPE_BYTES[settings.dtype], settings)
    return Plan(spec.name, spec.path, spec.source_hash, settings, entries, groups, totals)


def _entry(graph, op, elt: int) -> Entry:
    values = graph.values
    kind = OPS[op.kind]

    def shapes_on(axis):
        """Input shapes as the collectives of `axis` see them: local on every other axis."""
        return [values[v].local_shape(lay.with_(axis, I))
                for v, lay in zip(op.inputs, op.in_layouts)]

    # a conversion moves its value in the value's own dtype (fp32 per-token losses, int64 ids)
    moved = values[op.inputs[0]].elt_bytes(graph.spec.settings.dtype) if kind.converts() else elt
    fwd, bwd = kind.collectives(op, shapes_on, moved, graph.mesh)
    notes = []
    if kind.converts():
        notes.append(kind.boundary(op).function)
    if op.absorbed:
        notes.append("absorbs " + ", ".join(a.boundary.function for a in op.absorbed))
    for axis in sorted(op.partial_grads, key=graph.mesh.axes.index):
        notes.append(f"{axis}-partial grad: " + ", ".join(op.partial_grads[axis]))
    if op.tied_to:
        notes.append(f"weight shared with {op.tied_to}")
    if op.attrs.get("cp_comm_type_resolved") and op.in_layouts and op.in_layouts[0]["cp"] != I:
        notes.append(f"cp {op.attrs['cp_comm_type_resolved']}: {op.attrs['cp_comm_reason']}")
    entry = Entry(op.id, op.kind, op.impl, op.impl_reason, [str(x) for x in op.in_layouts],
                  [str(x) for x in op.out_layouts], fwd, bwd, 0, notes)
    local_in, local_out = _local_shapes(graph, op)
    entry.flops = tuple(kind.flops(op, local_in, local_out, graph.mesh))
    entry.kernel = kind.matmul_kernel(op)
    entry.kernel_flops = tuple(kind.kernel_flops(op, local_in, local_out, graph.mesh) or ())
    entry.weights = tuple((w.name, _local_weight_shape(w, graph.spec.settings)) for w in kind.weights(op.attrs))
    entry.comm_axes = (tuple(kind.comm_axis(op, k) for k, _ in fwd), tuple(kind.comm_axis(op, k) for k, _ in bwd))
    entry.comm_hidden = tuple(kind.comm_hidden(op))
    entry.memory = tuple(kind.memory_traffic(op, local_in, local_out, elt))
    entry.saved_items = _saved(graph, op, elt)
    entry.saved = sum(b for _, b in entry.saved_items)
    entry.working = kind.working_bytes(op, local_in, local_out, elt, graph.mesh)
    entry.region, entry.region_items = None, ()  # the recompute region it runs in, what it kept before
    return entry


def _recompute(graph, raw: list) -> None:
    """Recomputed regions (passes/recompute.py): the ops inside keep nothing for backward, the
    region keeps its checkpoint's inputs (counted at its first op), and backward runs the
    region's forward again, its collectives included."""
    rc = graph.recompute
    if rc is None or not rc.regions:
        return
    dtype, started = graph.spec.settings.dtype, set()
    for e in raw:
        index = rc.op_region.get(e.name)
        if index is None:
            continue
        region = rc.regions[index]
        e.region, e.region_items = index, tuple(e.saved_items)  # materialised again in its backward
        e.saved_items = []
        if index not in started:
            started.add(index)
            for vid in region.inputs:
                value = graph.values[vid]
                e.saved_items.append((vid, numel(value.local_shape())
                                      * value.elt_bytes(dtype)))
            e.notes.append(f"recompute {region.granularity}: keeps only the input"
                           + ("s" if len(region.inputs) > 1 else "") + ", runs again in backward")
        else:
            e.notes.append(f"recompute {region.granularity}")
        e.saved = sum(b for _, b in e.saved_items)
        e.backward = list(e.forward) + list(e.backward)  # the recompute repeats the forward's collectives
        e.comm_axes = (e.comm_axes[0], e.comm_axes[0] + e.comm_axes[1])
        e.memory = (e.memory[0], e.memory[0] + e.memory[1])
        e.recomputed = True


def _local_shapes(graph, op) -> tuple:
    values = graph.values
    local_in = [values[v].local_shape(lay) for v, lay in zip(op.inputs, op.in_layouts)]
    local_out = [values[v].local_shape(lay) for v, lay in zip(op.outputs, op.out_layouts)]
    return local_in, local_out


def _local_weight_shape(w, settings) -> tuple:
    shape = list(w.shape)
    if w.shard_dim is not None:
        segments = tuple(w.segments) or (shape[w.shard_dim],)
        shape[w.shard_dim] = sh_local_size(shape[w.shard_dim], settings.tp, segments, tuple(w.units))
    return tuple(shape)


def _rank_elements(w, settings) -> int:
    """Elements of a weight one rank holds: its TP shard, and of an expert weight its EP share."""
    return numel(_local_weight_shape(w, settings)) // (settings.ep if w.expert_dim is not None else 1)


def _replica_sum_elements(w, t: int) -> int:
    """Elements of the zero-padded gradient buffer that sums a weight's replicated heads over
    TP: each segment of fewer heads than ranks, at its full size."""
    if w.shard_dim is None or not w.units:
        return 0
    rest = numel(w.shape) // w.shape[w.shard_dim]
    return sum(size * rest for size, n in zip(w.segments or (w.shape[w.shard_dim],), w.units) if replicas(n, t) > 1)


def _saved(graph, op, elt: int) -> list:
    local_in, local_out = _local_shapes(graph, op)
    return OPS[op.kind].saved_bytes(op, local_in, local_out, elt)


def _fold(graph, raw: list):
    """Show a repeated module's ops once when all its instances are identical; nested repeats fold
    inside a folded instance too (`layers.*.experts.*`, counted as the product). Linear in the
    number of entries: each entry's name is read once for the instances it lies in."""
    chains = [_instances(graph.repeats, e.name) for e in raw]
    sigs: dict = {}  # repeated scope -> {instance index: signatures of the entries inside it}
    for e, chain in zip(raw, chains):
        for scope, index, _, end in chain:
            sigs.setdefault(scope, {}).setdefault(index, []).append(_signature(e, e.name[:end]))
    folds = {scope for scope, by_index in sigs.items()
             if len(by_index) == graph.repeats[scope] and all(s == by_index[0] for s in by_index.values())}
    by_module = _module_folds(graph, sigs, folds)
    out, groups = [], {}
    for e, chain in zip(raw, chains):
        pieces, last, count, shown = [], 0, 1, True
        for scope, index, start, end in chain:
            if scope in by_module:  # a hybrid pattern: each module's layers fold on their own
                module, first, n = by_module[scope][index]
                if index != first:
                    shown = False
                    break
                pieces += [e.name[last:start], "{" + module + "}"]
                last = end
                count *= n
                groups["".join(pieces)] = n
                continue
            if scope not in folds:
                continue
            if index != 0:  # instance 0 stands for all of them
                shown = False
                break
            pieces += [e.name[last:start], "*"]
            last = end
            count *= graph.repeats[scope]
            groups["".join(pieces)] = graph.repeats[scope]
        if shown:
            out.append(_renamed(e, "".join(pieces) + e.name[last:], count) if pieces else e)
    return out, groups


def _module_folds(graph, sigs: dict, folds: set) -> dict:
    """Repeated scopes whose layers are several modules (a hybrid pattern) with every module's
    layers identical: {scope: {index: (module, its first index, its count)}}, so the plan shows
    `layers.{MambaLayer}.mixer x24`. Not at PP > 1, where the time model places folded entries on
    the stages by layer index (the layers are listed one by one there)."""
    out = {}
    if graph.pipeline is not None:
        return out
    for scope, by_index in sigs.items():
        if scope in folds or len(by_index) != graph.repeats[scope]:
            continue
        members: dict = {}
        for index in range(graph.repeats[scope]):
            members.setdefault(graph.scopes[f"{scope}.{index}"], []).append(index)
        if len(members) > 1 and all(by_index[i] == by_index[ix[0]] for ix in members.values() for i in ix):
            out[scope] = {i: (module, ix[0], len(ix)) for module, ix in members.items() for i in ix}
    return out


_INDEX = re.compile(r"\d+")


def _instances(repeats: dict, name: str) -> list:
    """The instances of repeated modules an op (by its name) lies in, outermost first:
    [(repeated scope, index, start, end)] with name[start:end] the index's digits."""
    out = []
    j = name.find(".")
    while j != -1:
        if name[:j] in repeats:
            m = _INDEX.match(name, j + 1)
            if m and (m.end() == len(name) or name[m.end()] in ".:"):
                out.append((name[:j], int(m.group()), m.start(), m.end()))
        j = name.find(".", j + 1)
    return out


def _signature(e: Entry, prefix: str):
    return (e.name[len(prefix):], e.kind, e.impl, tuple(e.layouts_in), tuple(e.layouts_out), tuple(e.forward),
            tuple(e.backward), e.saved, tuple(n.replace(prefix, "") for n in e.notes), e.flops, e.weights,
            e.comm_axes, e.comm_hidden, e.memory, e.recomputed, e.kernel, e.kernel_flops)


def _renamed(e: Entry, name: str, count: int) -> Entry:
    out = Entry(name, e.kind, e.impl, e.impl_reason, e.layouts_in, e.layouts_out, e.forward, e.backward, e.saved,
                e.notes, count, e.flops, e.weights, e.comm_axes, e.comm_hidden, e.memory, e.recomputed, e.kernel,
                e.kernel_flops)
    out.saved_items = e.saved_items
    return out


def _totals(graph, raw: list, elt: int, settings) -> dict:
    coll = {k: {"count": 0, "bytes": 0} for k in COLLECTIVES[:3]}
    for e in raw:
        for kind, nbytes in e.forward + e.backward:
            c = coll.setdefault(kind, {"count": 0, "bytes": 0})  # send/recv only where CP makes them
            c["count"] += 1
            c["bytes"] += nbytes
    params, expert_params, seen = 0, 0, set()

    def per_rank(w) -> int:
        return _rank_elements(w, settings)

    replica_sum = 0  # elements of the zero-padded buffers that sum replicated heads' gradients over TP

    partial = {axis: 0 for axis in graph.mesh.active}
    partial_seen: set = set()  # (module, weight, axis): a row-parallel bias is the linear's and its bias_add's
    for op in graph.iter_ops():
        kind = OPS[op.kind]
        key = op.id.split("#")[0]
        if key in seen:  # an op called twice shares its weights
            continue
        seen.add(key)
        owned = kind.weights(op.attrs)
        params += sum(per_rank(w) for w in owned)
        replica_sum += sum(_replica_sum_elements(w, settings.tp) for w in owned)
        expert_params += sum(per_rank(w) for w in owned if w.expert_dim is not None)
        for w in owned + kind.shared_weights(op.attrs):
            for axis, names in op.partial_grads.items():
                if w.name in names and (op.scope, kind.owner(op), w.name, axis) not in partial_seen:
                    partial_seen.add((op.scope, kind.owner(op), w.name, axis))
                    partial[axis] += per_rank(w)
    sync_axes = {axis: n for axis, n in partial.items() if n}
    if replica_sum:  # in the same TP buffer as the TP-partial gradients (runtime.finalize_model_grads)
        sync_axes["tp"] = sync_axes.get("tp", 0) + replica_sum
    grad_sync = {"all_reduce": {"count": len(sync_axes), "bytes": sum(sync_axes.values()) * 4}}
    saved, seen_saved, per_layer = 0, set(), {}
    for e in raw:
        for key, nbytes in e.saved_items:
            if key in seen_saved:
                continue
            seen_saved.add(key)
            saved += nbytes
            layer = _layer_of(graph, e.name)
            if layer is not None:
                per_layer[layer] = per_layer.get(layer, 0) + nbytes
    # every op instance's matrix multiplies, forward and backward (docs/training.md: the FLOP count)
    flops_fwd = sum(e.flops[0] for e in raw)
    flops_bwd = sum(e.flops[1] for e in raw)
    totals = {
        "collectives": coll,
        "grad_sync": grad_sync,
        "parameters": params,
        "parameter_bytes": params * elt,
        "gradient_bytes": params * 4,
        "optimizer_bytes": params * OPT_BYTES[settings.dtype],
        "tp_partial_grad_parameters": partial.get("tp", 0),
        "activation_bytes": saved,
        "activation_working_bytes": working_set(raw),
        "activation_bytes_per_layer": dict(sorted(per_layer.items())),
        "flops": {"forward": flops_fwd, "backward": flops_bwd},
        "flops_per_step": flops_fwd + flops_bwd,
    }
    if settings.cp > 1:
        totals["cp_partial_grad_parameters"] = partial.get("cp", 0)
    if replica_sum:
        totals["replicated_head_grad_elements"] = replica_sum
    if expert_params:  # data-parallel over the expert-data-parallel group (dp / ep ranks)
        totals["expert_parameters"] = expert_params
        totals["expert_optimizer_bytes"] = expert_params * OPT_BYTES[settings.dtype]
    if graph.recompute is not None and graph.recompute.regions:
        # what recompute adds: the recomputed regions' forward, run again in backward (not model
        # FLOPs: MFU leaves it out; hardware FLOPs count it)
        totals["recompute_flops"] = sum(e.flops[0] for e in raw if getattr(e, "recomputed", False))
    if graph.pipeline is not None:
        totals["pipeline"] = _pipeline_totals(graph, raw, settings)
    return totals


def _pipeline_totals(graph, raw: list, settings) -> dict:
    """Per stage: layers, parameters and Adam state (a tied weight's copy counts on the last
    stage: it is a tensor there), the activations one micro-batch keeps for backward, how many
    micro-batches are in flight at the schedule's peak, the p2p bytes per micro-batch; and the
    bubble (P - 1) / (V·m + P - 1) for a few micro-batch counts m."""
    from ..passes.pipeline import bubble_fraction, in_flight

    pipe = graph.pipeline
    last = len(pipe.stages) - 1

    def stage_of(scope: str, pre: bool) -> int:
        s = pipe.stage_of_scope(scope)
        return s if s >= 0 else (0 if pre else last)

    first_layer_op = next(i for i, op in enumerate(graph.iter_ops())
                          if op.scope == pipe.block or op.scope.startswith(pipe.block + "."))
    params = [0] * len(pipe.stages)
    experts = [0] * len(pipe.stages)  # of which expert weights (data-parallel over DP / EP ranks)
    acts = [0] * len(pipe.stages)
    on_stage: list = [[] for _ in pipe.stages]  # each stage's entries, in forward order
    seen, seen_saved = set(), set()
    copies = {copy for _, copy in pipe.ties}
    for i, (op, e) in enumerate(zip(graph.iter_ops(), raw)):
        s = stage_of(op.scope, i < first_layer_op)
        on_stage[s].append(e)
        key = op.id.split("#")[0]
        if key not in seen:
            seen.add(key)
            kind = OPS[op.kind]
            owned = list(kind.weights(op.attrs)) + (list(kind.shared_weights(op.attrs)) if op.id in copies else [])
            params[s] += sum(_rank_elements(w, settings) for w in owned)
            experts[s] += sum(_rank_elements(w, settings) for w in owned if w.expert_dim is not None)
        for k, nbytes in e.saved_items:
            if (s, k) not in seen_saved:
                seen_saved.add((s, k))
                acts[s] += nbytes
    m = 8 * pipe.size  # the peak is reached for any m >= 2P that is a multiple of P
    stages = []
    for st in pipe.stages:
        flight = in_flight(st, pipe.size, pipe.virtual, m)
        stages.append({
            "stage": st.index, "rank": st.rank, "chunk": st.chunk, "layers": list(st.layers),
            "pre_process": st.pre_process, "post_process": st.post_process,
            "parameters": params[st.index], "expert_parameters": experts[st.index],
            "optimizer_bytes": params[st.index] * OPT_BYTES[settings.dtype],
            "activation_bytes": acts[st.index], "activation_working_bytes": working_set(on_stage[st.index]),
            "in_flight": flight,
            "send_bytes": sum(x.bytes for x in st.send), "recv_bytes": sum(x.bytes for x in st.recv),
            # of which sent as 1/t slices and all-gathered over TP on arrival (runtime/pipeline.py)
            "send_scattered_bytes": sum(x.bytes for x in st.send if scattered_over_tp(x, settings.tp)),
            "recv_scattered_bytes": sum(x.bytes for x in st.recv if scattered_over_tp(x, settings.tp)),
            "flops": st.cost,
        })
    ranks = []
    for r in range(pipe.size):
        mine = [x for x in stages if x["rank"] == r]
        peak = max(x["activation_bytes"] for x in mine) * mine[0]["in_flight"] if pipe.virtual > 1 else \
            mine[0]["activation_bytes"] * mine[0]["in_flight"]
        ranks.append({"rank": r, "stages": [x["stage"] for x in mine],
                      "parameters": sum(x["parameters"] for x in mine),
                      "expert_parameters": sum(x["expert_parameters"] for x in mine),
                      "optimizer_bytes": sum(x["optimizer_bytes"] for x in mine),
                      "peak_activation_bytes": peak, "in_flight": mine[0]["in_flight"],
                      "activation_working_bytes": max(x["activation_working_bytes"] for x in mine)})
    return {
        "size": pipe.size, "virtual": pipe.virtual, "block": pipe.block, "placement": pipe.placement,
        "schedule": "interleaved 1F1B" if pipe.virtual > 1 else "1F1B",
        "stages": stages, "ranks": ranks,
        "ties": [{"weight": owner, "copy": copy} for owner, copy in pipe.ties],
        "bubble": {str(k * pipe.size): round(bubble_fraction(pipe.size, pipe.virtual, k * pipe.size), 6)
                   for k in (1, 2, 4, 8)},
    }


def working_set(entries: list) -> int:
    """Bytes one micro-batch's backward holds at its fullest beyond what the entries keep for
    backward (`saved_items`; entries in forward order, one stage's). Two kinds of moment:

    * a recompute region's backward: its forward runs again and its ops keep what they kept
      without recompute (`region_items`) until their backward has run, one region at a time;
    * an op's own temporaries (`working`: the loss's fp32 logits and gradients).

    Backward runs in reverse, so at either moment what the entries after it kept is already
    freed (a tensor is freed when every entry that keeps it has run its backward). The largest
    moment's bytes held beyond the kept ones, at least 0."""
    first_holder: dict = {}
    size: dict = {}
    for i, e in enumerate(entries):
        for key, nbytes in e.saved_items:
            first_holder.setdefault(key, i)
            size[key] = nbytes
    first_kept = [0] * len(entries)  # bytes of the kept tensors whose first holder is entry i
    for key, i in first_holder.items():
        first_kept[i] += size[key]
    freed_after = [0] * len(entries)  # kept bytes whose holders all come after entry i
    for i in range(len(entries) - 2, -1, -1):
        freed_after[i] = freed_after[i + 1] + first_kept[i + 1]
    regions: dict = {}  # region index -> (last entry's position, {key: bytes} materialised again)
    best = 0
    for i, e in enumerate(entries):
        if e.working:
            best = max(best, e.working - freed_after[i])
        if e.region is not None:
            items = regions.get(e.region, (i, {}))[1]
            items.update((k, b) for k, b in e.region_items if k not in first_holder)  # not kept anyway
            regions[e.region] = (i, items)
    for last, items in regions.values():
        best = max(best, sum(items.values()) - freed_after[last])
    return best


def scattered_over_tp(item, tp: int) -> bool:
    """Whether the runtime sends a pipeline p2p tensor as each TP rank's 1/t slice of its last dim,
    all-gathered over TP by the receiver (runtime/pipeline.py `scattered`, Narayanan et al. 2021's
    scatter/gather): TP > 1, the value replicated over tp (no sequence parallelism) and its last
    dim divisible by t."""
    axes = dict(part.split(":", 1) for part in item.layout.split("/")) if ":" in item.layout else None
    replicated = item.layout == "I" if axes is None else axes.get("tp") == "I"
    return tp > 1 and replicated and bool(item.shape) and item.shape[-1] % tp == 0


def _layer_of(graph, name: str):
    """The outermost repeated-module instance an op lies in (`layers.3`), or None."""
    chain = _instances(graph.repeats, name)
    return name[:chain[0][3]] if chain else None
