"""Shared helpers for the compiler tests: compile a spec at some settings in memory."""

from __future__ import annotations

import os

import pytest

from specc.frontend.model import Settings
from specc.pipeline import load_and_compile

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SPECS = os.path.join(ROOT, "specs")


def spec_path(name: str) -> str:
    return os.path.join(SPECS, name)


@pytest.fixture
def compiled():
    def make(name: str, tp: int = 1, sp: bool = False, overrides=(), **settings):
        from specc.errors import Loc

        located = [(k, v, Loc("--set")) for k, v in dict(overrides).items()]
        return load_and_compile(spec_path(name), Settings(tp=tp, sp=sp, **settings), located, lint=True)

    return make


@pytest.fixture
def names_bases_that_declare_it():
    """Checks a Megatron-flag hint: it names shipped specs that declare the flag, the ones
    extending no other named spec first (full specs before their tiny test versions), and its
    example runs the first."""
    import re

    from specc.frontend.megatron import shipped

    def check(hint: str) -> None:
        named = re.findall(r"specs/[\w.-]+\.yaml", hint.split(" have it", 1)[0].split(" map it", 1)[0])
        extends = {p: m.extends for p, m in shipped()}
        assert named and all(p in extends for p in named)
        assert extends[named[0]] not in named
        assert f"specs/{named[0].split('/')[1]}" in hint.split(": ")[-1]

    return check
