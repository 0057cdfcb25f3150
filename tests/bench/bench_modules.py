"""The benchmarks are scripts in bench/, not a package: load one by name for its tests."""

from __future__ import annotations

import importlib.util
import os
import sys

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))


def load(name: str):
    """bench/<name>.py as the module `name` (registered in sys.modules: dataclasses and spawned
    ranks look their module up there), with bench/ importable for the modules it imports."""
    if os.path.join(ROOT, "bench") not in sys.path:
        sys.path.insert(0, os.path.join(ROOT, "bench"))
    spec = importlib.util.spec_from_file_location(name, os.path.join(ROOT, "bench", f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module
