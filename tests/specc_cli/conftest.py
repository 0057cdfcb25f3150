"""Shared fixtures of the command-line tests."""

from __future__ import annotations

import pytest


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
