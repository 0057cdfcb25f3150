"""Shared fixtures of the command-line tests."""

from __future__ import annotations

import os
import sys

import pytest

# gloo_launch.py beside these tests, importable by name here and in the gloo ranks
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture
def ranks_on_gloo(gloo, monkeypatch):
    """ranks_on_gloo() -> from then on in the test, `specc train --nproc-per-node N` runs its N
    ranks on the session's gloo pool instead of launching torchrun (tests/specc_cli/gloo_launch.py);
    returns the list of the torchrun commands that would have been launched."""
    from gloo_launch import install

    return lambda: install(gloo, monkeypatch)


@pytest.fixture
def names_bases_that_declare_it():
    """Checks a Megatron-flag hint: it names shipped specs that declare the flag, the ones
    extending no other named spec first (full specs before their tiny test versions), and its
    example runs the first."""
    import re

    from specc.frontend.megatron_specs import shipped

    def check(hint: str) -> None:
        named = re.findall(r"specs/[\w.-]+\.yaml", hint.split(" have it", 1)[0].split(" map it", 1)[0])
        extends = {p: m.extends for p, m in shipped()}
        assert named and all(p in extends for p in named)
        assert extends[named[0]] not in named
        assert f"specs/{named[0].split('/')[1]}" in hint.split(": ")[-1]

    return check
