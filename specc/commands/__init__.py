"""Subcommands that live in their own modules. Each module has `add_parsers(sub)`; none may
import torch at import time (the CLI must start fast): they import the runtime when they run."""

from __future__ import annotations

import importlib

MODULES: tuple = ("train", "data", "plot", "hf")


def register_all(sub) -> None:
    for name in MODULES:
        importlib.import_module(f"{__name__}.{name}").add_parsers(sub)
