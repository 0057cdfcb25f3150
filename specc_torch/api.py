"""The public Python API over both layers: a compiled model for given settings and process
groups, from a spec (compiled in memory by specc) or from a generated directory, with
TP-invariant weights from a seed.

    import specc_torch
    pg = runtime.ProcessGroups.initialize(tp=2)            # after dist.init_process_group
    model = specc_torch.build_model("specs/gpt-tiny.yaml", pg, seed=1234, sp=True)
    loss = model(tokens, labels).mean()

A generated directory needs no compiler: `runtime.build_model("generated/gpt_tp2_sp", pg)`.
"""

from __future__ import annotations

import os

from runtime.api import load_generated, load_module_from_source
from runtime.parallel_state import ProcessGroups
from specc.compiler import load_and_compile
from specc.emit.emitter import emit_model
from specc.emit.recipe import command_of, make_recipe
from specc.errors import Loc
from specc.settings import Settings

__all__ = ["build_model", "compile_source", "load_generated", "load_module_from_source"]


def compile_source(spec_path: str, settings: Settings = Settings(), overrides=()):
    """(model.py source, spec, graph) for a spec at these settings (specc.settings.Settings),
    compiled in memory; `overrides`: config values over the spec's ({name: value})."""
    if not isinstance(settings, Settings):
        raise TypeError(f"compile_source takes a specc.settings.Settings, not {type(settings).__name__}: "
                        f"compile_source(spec, Settings(tp=2, sp=True), overrides)")
    located = [(k, v, Loc(f"--set {k}={v}")) for k, v in dict(overrides).items()]
    spec, graph = load_and_compile(spec_path, settings, located)
    recipe = make_recipe(spec_path, settings, located)
    return emit_model(graph, command_of(recipe), recipe), spec, graph


def build_model(source: str, pg: ProcessGroups | None = None, seed: int = 1234, sp: bool = False,
                rng_tracker=None, overrides=(), **settings):
    """A model from a spec file (.yaml, compiled for pg's TP, CP and EP sizes, at fp32 unless
    `settings` say otherwise: they are Settings fields) or a generated directory. `sp` on a
    group of one TP rank is off, as Megatron turns it off (the same code serves every TP size)."""
    pg = pg if pg is not None else ProcessGroups.single()
    if os.path.isdir(source):
        module = load_generated(source)
    else:
        sizes = {"tp": pg.tp.size, "cp": pg.cp.size, "ep": pg.ep.size, "sp": sp and pg.tp.size > 1, "dtype": "fp32"}
        text, spec, _ = compile_source(source, Settings(**{**sizes, **settings}), overrides)
        module = load_module_from_source(text, spec.name)
    return module.build_model(pg, seed=seed, rng_tracker=rng_tracker)
