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
from specc.emit.emitter import emit_model
from specc.errors import Loc
from specc.frontend.model import Settings
from specc.pipeline import load_and_compile

__all__ = ["build_model", "compile_source", "load_generated", "load_module_from_source"]


def compile_source(spec_path: str, tp: int, sp: bool = False, backend: str = "auto", overrides=(),
                   micro_batch_size: int = 1, dtype: str = "fp32", fuse: bool = True, cp: int = 1,
                   cp_comm_type: str = "auto", pp: int = 1, pp_virtual_stage_layers: int | None = None,
                   pp_first_stage_layers: int | None = None, pp_last_stage_layers: int | None = None,
                   pp_layout: str | None = None, ep: int = 1,
                   recompute: dict | None = None):
    """(model.py source, spec, graph) for a spec at these settings, compiled in memory. `recompute`:
    Settings' recompute fields (specc_cli.args.recompute_from), e.g. {"recompute_granularity": "selective"}."""
    settings = Settings(tp=tp, sp=sp and tp > 1, backend=backend, micro_batch_size=micro_batch_size, dtype=dtype,
                        fuse=fuse, cp=cp, cp_comm_type=cp_comm_type if cp > 1 else "auto", pp=pp,
                        pp_virtual_stage_layers=pp_virtual_stage_layers, pp_first_stage_layers=pp_first_stage_layers,
                        pp_last_stage_layers=pp_last_stage_layers, pp_layout=pp_layout, ep=ep,
                        **(recompute or {}))
    located = [(k, v, Loc(f"--set {k}={v}")) for k, v in dict(overrides).items()]
    spec, graph = load_and_compile(spec_path, settings, located)
    command = f"specc compile {spec_path} --tp {tp}" + (" --sp" if settings.sp else "") + (
        f" --cp {cp}" if cp > 1 else "") + (f" --cp-comm-type {settings.cp_comm_type}" if settings.cp_comm_type != "auto" else "") \
        + (f" --pp {pp}" if pp > 1 else "") + (f" --num-layers-per-virtual-pipeline-stage {pp_virtual_stage_layers}"
                                               if pp_virtual_stage_layers else "") + (
        f" --ep {ep}" if ep > 1 else "")
    command += "".join(f" --{k.replace('_', '-')} {v}" for k, v in settings.recompute_dict().items() if v is not None)
    return emit_model(graph, command), spec, graph


def build_model(source: str, pg: ProcessGroups | None = None, seed: int = 1234, sp: bool = False,
                rng_tracker=None, **compile_kwargs):
    """A model from a spec file (.yaml, compiled for pg's TP and CP sizes) or a generated directory."""
    pg = pg if pg is not None else ProcessGroups.single()
    if os.path.isdir(source):
        module = load_generated(source)
    else:
        compile_kwargs.setdefault("cp", pg.cp.size)
        compile_kwargs.setdefault("ep", pg.ep.size)
        text, spec, _ = compile_source(source, pg.tp.size, sp, **compile_kwargs)
        module = load_module_from_source(text, spec.name)
    return module.build_model(pg, seed=seed, rng_tracker=rng_tracker)
