"""Shared helpers for the compiler tests: compile a spec at some settings in memory."""

from __future__ import annotations

import os

import pytest

from specc.compiler import load_and_compile
from specc.frontend.model import Settings

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
