"""The public Python API: a compiled model for given settings and process groups, from a spec
(compiled in memory) or from a generated directory, with TP-invariant weights from a seed.

    import runtime
    pg = runtime.ProcessGroups.initialize(tp=2)            # after dist.init_process_group
    model = runtime.build_model("specs/gpt-tiny.yaml", pg, seed=1234, sp=True)
    loss = model(tokens, labels).mean()
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import sys
import types

from .parallel_state import ProcessGroups


def compile_source(spec_path: str, tp: int, sp: bool = False, backend: str = "auto", overrides=(),
                   micro_batch_size: int = 1, dtype: str = "fp32", fuse: bool = True, cp: int = 1,
                   cp_comm_type: str = "auto"):
    """(model.py source, spec, graph) for a spec at these settings, compiled in memory."""
    from specc.emit.emitter import emit_model
    from specc.errors import Loc
    from specc.frontend.model import Settings
    from specc.pipeline import load_and_compile

    settings = Settings(tp=tp, sp=sp and tp > 1, backend=backend, micro_batch_size=micro_batch_size, dtype=dtype,
                        fuse=fuse, cp=cp, cp_comm_type=cp_comm_type if cp > 1 else "auto")
    located = [(k, v, Loc(f"--set {k}={v}")) for k, v in dict(overrides).items()]
    spec, graph = load_and_compile(spec_path, settings, located)
    command = f"specc compile {spec_path} --tp {tp}" + (" --sp" if settings.sp else "") + (
        f" --cp {cp}" if cp > 1 else "") + (f" --cp-comm-type {settings.cp_comm_type}" if settings.cp_comm_type != "auto" else "")
    return emit_model(graph, command), spec, graph


def load_module_from_source(source: str, name_hint: str = "specc_model") -> types.ModuleType:
    """Execute generated source as a fresh module (each distinct source gets its own module)."""
    digest = hashlib.sha256(source.encode()).hexdigest()[:12]
    name = f"_specc_generated_{name_hint}_{digest}"
    if name in sys.modules:
        return sys.modules[name]
    module = types.ModuleType(name)
    module.__file__ = f"<specc:{name_hint}>"
    code = compile(source, module.__file__, "exec")
    exec(code, module.__dict__)
    sys.modules[name] = module
    return module


def load_generated(directory: str) -> types.ModuleType:
    """Import generated/NAME/model.py by path."""
    path = os.path.join(directory, "model.py")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{directory}: no model.py (compile a spec with `specc compile` first)")
    name = "_specc_dir_" + hashlib.sha256(os.path.abspath(path).encode()).hexdigest()[:12]
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def build_model(source: str, pg: ProcessGroups | None = None, seed: int = 1234, sp: bool = False,
                rng_tracker=None, **compile_kwargs):
    """A model from a spec file (.yaml, compiled for pg's TP size) or a generated directory."""
    pg = pg if pg is not None else ProcessGroups.single()
    if os.path.isdir(source):
        module = load_generated(source)
    else:
        compile_kwargs.setdefault("cp", pg.cp.size)
        text, spec, _ = compile_source(source, pg.tp.size, sp, **compile_kwargs)
        module = load_module_from_source(text, spec.name)
    return module.build_model(pg, seed=seed, rng_tracker=rng_tracker)
