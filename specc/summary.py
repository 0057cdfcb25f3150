"""One-line summaries of a spec, derived from its graph (no model family names needed)."""

from __future__ import annotations

from .ops import OPS
from .ops.base import numel


def parameter_count(graph, activated: bool = False) -> int:
    """Full (unsharded) parameters, each shared weight counted once; `activated`: those one
    token's forward uses (a MoE op's top-k experts of its routed ones)."""
    total, seen = 0, set()
    for op in graph.iter_ops():
        base = op.id.split("#")[0]
        if OPS[op.kind].converts() or base in seen:
            continue
        seen.add(base)
        kind = OPS[op.kind]
        total += kind.active_parameters(op.attrs) if activated else sum(numel(w.shape) for w in kind.weights(op.attrs))
    return total


def summarize(graph) -> str:
    spec = graph.spec
    # the layers of every outermost repeat (DeepSeek-V3's dense first layers, then its MoE layers:
    # two repeats), not the longest one
    outer = [s for s in graph.repeats if not any(s.startswith(o + ".") for o in graph.repeats)]
    layers = sum(graph.repeats[s] for s in outer)
    heads = next((op.attrs["num_heads"] for op in graph.iter_ops() if op.kind == "core_attention"), None)
    hidden = None
    for scope in graph.repeats:
        first = next((op for op in graph.iter_ops() if op.scope.startswith(scope + ".0")), None)
        if first is not None and first.inputs:
            hidden = graph.values[first.inputs[0]].shape[-1]
            break
    parts = [f"{layers} layers{_kinds(graph, outer)}" if layers else "no repeated layers"]
    if hidden is not None:
        parts.append(f"hidden {hidden}")
    if heads is not None:
        parts.append(f"{heads} heads")
    total, active = parameter_count(graph), parameter_count(graph, activated=True)
    parts.append(f"{total:,} parameters" + (f" ({active:,} activated per token)" if active != total else ""))
    return f"{spec.name}: " + ", ".join(parts)


def _kinds(graph, outer: list) -> str:
    """How many layers of each module the outermost repeats hold (a per-layer pattern, or two
    repeats one after the other): " (24 MambaLayer, 4 AttentionLayer, 24 MLPLayer)"; "" when
    they are all one module."""
    counts: dict = {}
    for scope in outer:
        for i in range(graph.repeats[scope]):
            module = graph.scopes[f"{scope}.{i}"]
            counts[module] = counts.get(module, 0) + 1
    return "" if len(counts) == 1 else " (" + ", ".join(f"{n} {m}" for m, n in counts.items()) + ")"
