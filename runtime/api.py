"""Loading generated modules: a model from a generated directory (`specc compile`'s output) for
given process groups, with TP-invariant weights from a seed. Nothing here needs the compiler;
a model from a spec file, compiled in memory, is `specc_torch.build_model`.

    import runtime
    pg = runtime.ProcessGroups.initialize(tp=2)            # after dist.init_process_group
    model = runtime.build_model("generated/gpt_tp2_sp", pg, seed=1234)   # compiled at TP=2 with SP
    loss = model(tokens, labels).mean()
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import sys
import types

from .parallel_state import ProcessGroups


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


def load_module_from_file(path: str) -> types.ModuleType:
    """Import a generated model.py by its real path, so tracebacks inside the model show its
    source lines (a module exec'd from a string has none to show)."""
    name = "_specc_file_" + hashlib.sha256(os.path.abspath(path).encode()).hexdigest()[:12]
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
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


def build_model(source: str, pg: ProcessGroups | None = None, seed: int = 1234, *, rng_tracker=None):
    """A model from a generated directory (its model.py), for pg's ranks."""
    pg = pg if pg is not None else ProcessGroups.single()
    if not os.path.isdir(source):
        if source.endswith((".yaml", ".yml")):
            raise ValueError(f"{source}: a spec file; runtime.build_model takes a generated directory (compiling a "
                             f"spec needs the compiler: use specc_torch.build_model({source!r}, pg, ...))")
        raise FileNotFoundError(f"{source}: no such generated directory")
    return load_generated(source).build_model(pg, seed=seed, rng_tracker=rng_tracker)
