"""One-line summaries of a spec, derived from its graph (no model family names needed)."""

from __future__ import annotations

from .ops import OPS
from .ops.base import numel


def parameter_count(graph) -> int:
    """Full (unsharded) parameters, each shared weight counted once."""
    total, seen = 0, set()
    for op in graph.iter_ops():
        base = op.id.split("#")[0]
        if OPS[op.kind].converts() or base in seen:
            continue
        seen.add(base)
        total += sum(numel(w.shape) for w in OPS[op.kind].weights(op.attrs))
    return total


def summarize(graph) -> str:
    spec = graph.spec
    layers = max(graph.repeats.values(), default=0)
    heads = next((op.attrs["num_heads"] for op in graph.iter_ops() if op.kind == "core_attention"), None)
    hidden = None
    for scope in graph.repeats:
        first = next((op for op in graph.iter_ops() if op.scope.startswith(scope + ".0")), None)
        if first is not None and first.inputs:
            hidden = graph.values[first.inputs[0]].shape[-1]
            break
    parts = [f"{layers} layers{_kinds(graph, layers)}" if layers else "no repeated layers"]
    if hidden is not None:
        parts.append(f"hidden {hidden}")
    if heads is not None:
        parts.append(f"{heads} heads")
    parts.append(f"{parameter_count(graph):,} parameters")
    return f"{spec.name}: " + ", ".join(parts)


def _kinds(graph, layers: int) -> str:
    """How many layers of each module a repeat with a per-layer pattern holds: " (24 MambaLayer,
    4 AttentionLayer, 24 MLPLayer)"; "" when its layers are all one module."""
    scope = next(s for s, n in graph.repeats.items() if n == layers)
    counts: dict = {}
    for i in range(layers):
        module = graph.scopes[f"{scope}.{i}"]
        counts[module] = counts.get(module, 0) + 1
    return "" if len(counts) == 1 else " (" + ", ".join(f"{n} {m}" for m, n in counts.items()) + ")"
