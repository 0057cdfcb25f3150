"""The compiler: spec file -> typed, optimized op graph -> Plan (the pass sequence; pipeline
parallelism is specc/passes/pipeline.py and runtime/pipeline.py)."""

from __future__ import annotations

from .errors import Loc, SpecError
from .frontend.load import load_spec
from .ir import build_graph
from .ops import OPS
from .passes.optimize import cancel_inverses, fuse_boundaries
from .passes.parallelize import parallelize
from .passes.pipeline import cut_pipeline
from .passes.recompute import mark_recompute
from .passes.resolve import available, resolve
from .settings import Settings


def compile_graph(spec, have=available, lint: bool = False, plan_only: bool = False):
    """Build, resolve, type and optimize; with `lint`, check the graph's invariants after every
    pass (the tests do). plan_only: the graph is planned, not emitted to run (a backend asked
    for by name need not be installed: passes.resolve)."""
    graph = build_graph(spec)
    _check_expert_parallel(graph, spec.settings)
    passes = [lambda g: resolve(g, spec.settings, have, plan_only), lambda g: parallelize(g, spec.settings),
              cancel_inverses]
    if spec.settings.fuse:
        passes.append(fuse_boundaries)
    passes.append(mark_recompute)  # last: it reads the final module calls
    if lint:
        graph.lint()
    for run in passes:
        run(graph)
        if lint:
            graph.lint()
    cut_pipeline(graph, spec.settings)  # reads the typed graph (p2p layouts), changes nothing in it
    return graph


def _check_expert_parallel(graph, settings) -> None:
    """--ep splits stacked expert weights (a weight's expert_dim); a spec without any has nothing
    to split, and silently running it at EP=1 would hide the mistake."""
    if getattr(settings, "ep", 1) <= 1:
        return
    if not any(w.expert_dim is not None for op in graph.iter_ops() for w in OPS[op.kind].weights(op.attrs)):
        raise SpecError(Loc(f"--expert-model-parallel-size {settings.ep}"),
                        "this spec has no expert weights to split over expert-parallel ranks",
                        "drop --expert-model-parallel-size, or use a mixture-of-experts spec (docs/moe.md)")


def load_and_compile(path: str, settings: Settings = Settings(), overrides=(), have=available, lint: bool = False,
                     plan_only: bool = False):
    spec = load_spec(path, settings, overrides)
    return spec, compile_graph(spec, have, lint, plan_only)
