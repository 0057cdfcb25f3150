"""The compiler pipeline: spec file -> typed, optimized op graph -> Plan."""

from __future__ import annotations

from .frontend.load import load_spec
from .frontend.model import Settings
from .ir import build_graph
from .passes.optimize import cancel_inverses, fuse_boundaries
from .passes.parallelize import parallelize
from .passes.resolve import available, resolve


def compile_graph(spec, have=available):
    graph = build_graph(spec)
    resolve(graph, spec.settings, have)
    parallelize(graph, spec.settings)
    cancel_inverses(graph)
    if spec.settings.fuse:
        fuse_boundaries(graph)
    return graph


def load_and_compile(path: str, settings: Settings = Settings(), overrides=(), have=available):
    spec = load_spec(path, settings, overrides)
    return spec, compile_graph(spec, have)
