"""The `megatron:` blocks of specs on disk (after `extends`), and of the shipped specs: what the
command line reads to accept a spec's Megatron flags and to name the specs that declare a flag.
The block's form is specc/frontend/megatron.py, which the loader checks."""

from __future__ import annotations

import os

from ..errors import SpecError
from .load import read_spec
from .megatron import MegatronFlags, check_megatron
from .yamlload import LDict, load_yaml, read_text

SHIPPED_SPECS = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "specs")


def read_megatron(path: str) -> MegatronFlags:
    """The `megatron:` block of the spec at `path`, after `extends`. Raises SpecError."""
    raw = read_spec(path)
    config = raw.get("config", LDict())
    config = config if isinstance(config, LDict) else LDict()
    out = MegatronFlags()
    if "megatron" in raw:
        out = check_megatron(raw["megatron"], raw.value_loc("megatron"), config)
    out.config = set(config)
    return out


def shipped() -> list:
    """(display path, MegatronFlags) of each shipped spec that reads cleanly, in name order."""
    out = []
    if not os.path.isdir(SHIPPED_SPECS):
        return out
    for name in sorted(os.listdir(SHIPPED_SPECS)):
        if not name.endswith((".yaml", ".yml")):
            continue
        path = os.path.join(SHIPPED_SPECS, name)
        try:
            flags = read_megatron(path)
            own = load_yaml(read_text(path), path)  # its own text: the spec it extends
        except SpecError:
            continue
        parent = own.get("extends") if isinstance(own, LDict) else None
        flags.extends = f"specs/{os.path.normpath(parent)}" if isinstance(parent, str) else None
        out.append((f"specs/{name}", flags))
    return out
