"""From a typed op graph to the Plan: one entry per op, repeated layers folded, step totals."""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from .. import __version__
from ..ir.graph import DTYPE_BYTES
from ..layouts import COLLECTIVES, local_shape
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
    spec, settings = graph.spec, graph.spec.settings
    elt = DTYPE_BYTES[settings.dtype]
    raw = [_entry(graph, op, elt, settings.tp) for op in graph.iter_ops()]
    entries, groups = _fold(graph, raw)
    totals = _totals(graph, raw, elt, settings)
    return Plan(spec.name, spec.path, spec.source_hash, settings, entries, groups, totals)


def _entry(graph, op, elt: int, tp: int) -> Entry:
    values = graph.values
    full_in = [values[v].shape for v in op.inputs]
    if op.kind == "boundary":
        nbytes = numel(full_in[0]) * elt
        fwd = [(op.boundary.forward, nbytes)] if op.boundary.forward in COLLECTIVES else []
        bwd = [(op.boundary.backward, nbytes)] if op.boundary.backward in COLLECTIVES else []
        notes = [op.boundary.function]
        saved = 0
    else:
        kind = OPS[op.kind]
        fwd, bwd = kind.collectives(op, full_in, elt, tp)
        notes = []
        if op.absorbed:
            notes.append("absorbs " + ", ".join(a.boundary.function for a in op.absorbed))
        if op.partial_grad:
            notes.append("tp-partial grad: " + ", ".join(op.partial_grad))
        if op.tied_to:
            notes.append(f"weight shared with {op.tied_to}")
        saved = 0
    entry = Entry(op.id, op.kind, op.impl, op.impl_reason, list(op.in_layouts), list(op.out_layouts), fwd, bwd, saved,
                  notes)
    entry.saved_items = _saved(graph, op, elt, tp)
    entry.saved = sum(b for _, b in entry.saved_items)
    return entry


def _saved(graph, op, elt: int, tp: int) -> list:
    if op.kind == "boundary":
        return []
    values = graph.values
    local_in = [local_shape(values[v].shape, lay, tp) for v, lay in zip(op.inputs, op.in_layouts)]
    local_out = [local_shape(values[v].shape, lay, tp) for v, lay in zip(op.outputs, op.out_layouts)]
    return OPS[op.kind].saved_bytes(op, local_in, local_out, elt)


def _fold(graph, raw: list):
    """Show a repeated module's ops once when all its instances are identical."""
    groups = {}
    patterns = {}
    for scope, count in sorted(graph.repeats.items()):
        rx = re.compile(re.escape(scope) + r"\.(\d+)(\.|:|$)")
        by_index: dict = {}
        for e in raw:
            m = rx.match(e.name)
            if m:
                by_index.setdefault(int(m.group(1)), []).append(e)
        sigs = {i: [_signature(e, f"{scope}.{i}") for e in es] for i, es in by_index.items()}
        if len(by_index) == count and all(s == sigs[0] for s in sigs.values()):
            patterns[scope] = rx
            groups[f"{scope}.*"] = count
    out = []
    for e in raw:
        folded = False
        for scope, rx in patterns.items():
            m = rx.match(e.name)
            if m:
                folded = True
                if int(m.group(1)) == 0:
                    out.append(_renamed(e, f"{scope}.*" + e.name[m.end(1):], groups[f"{scope}.*"]))
        if not folded:
            out.append(e)
    return out, groups


def _signature(e: Entry, prefix: str):
    return (e.name[len(prefix):], e.kind, e.impl, tuple(e.layouts_in), tuple(e.layouts_out), tuple(e.forward),
            tuple(e.backward), e.saved, tuple(n.replace(prefix, "") for n in e.notes))


def _renamed(e: Entry, name: str, count: int) -> Entry:
    out = Entry(name, e.kind, e.impl, e.impl_reason, e.layouts_in, e.layouts_out, e.forward, e.backward, e.saved,
                e.notes, count)
    out.saved_items = e.saved_items
    return out


def _totals(graph, raw: list, elt: int, settings) -> dict:
    coll = {k: {"count": 0, "bytes": 0} for k in COLLECTIVES}
    for e in raw:
        for kind, nbytes in e.forward + e.backward:
            coll[kind]["count"] += 1
            coll[kind]["bytes"] += nbytes
    params, partial, seen = 0, 0, set()
    for op in graph.iter_ops():
        if op.kind == "boundary":
            continue
        key = op.id.split("#")[0]
        if key in seen:  # an op called twice shares its weights
            continue
        seen.add(key)
        if op.kind == "bias_add" and op.partial_grad:  # the row-parallel linear's bias, used on S(s)
            partial += op.attrs["size"]
        for w in OPS[op.kind].weights(op.attrs):
            n = numel(w.shape) // (settings.tp if w.shard_dim is not None else 1)
            params += n
            if w.name in op.partial_grad:
                partial += n
    grad_sync = {"all_reduce": {"count": 1 if partial else 0, "bytes": partial * 4}}
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
    return {
        "collectives": coll,
        "grad_sync": grad_sync,
        "parameters": params,
        "parameter_bytes": params * elt,
        "gradient_bytes": params * 4,
        "optimizer_bytes": params * OPT_BYTES[settings.dtype],
        "tp_partial_grad_parameters": partial,
        "activation_bytes": saved,
        "activation_bytes_per_layer": dict(sorted(per_layer.items())),
    }


def _layer_of(graph, name: str):
    for scope in graph.repeats:
        m = re.match(re.escape(scope) + r"\.(\d+)(\.|:|$)", name)
        if m:
            return f"{scope}.{m.group(1)}"
    return None
