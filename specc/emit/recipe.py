"""What a generated folder was compiled from, as data: the spec path, the settings and the config
overrides. model.py records it as SETTINGS; COMPILE_COMMAND is derived from it for people, and
`specc check` and `specc diff` rebuild from the data, never by re-parsing a command line."""

from __future__ import annotations

import ast
import os
import shlex
from dataclasses import fields

from ..errors import Loc, SpecError
from ..settings import Settings


def make_recipe(spec_path: str, settings: Settings, overrides=()) -> dict:
    """SETTINGS of a generated module: the settings, the spec path (relative to the working
    directory, with /) and the overrides [(key, value)], in a fixed key order."""
    spec = os.path.relpath(spec_path) if not os.path.isabs(spec_path) else spec_path
    return {**settings.as_dict(), "spec": spec.replace(os.sep, "/"),
            "overrides": [[key, value] for key, value, *_ in overrides]}


def command_of(recipe: dict) -> str:
    """The `specc compile` command that reproduces a recipe (shell-quoted): the settings' flags
    (Settings.command_flags), then the overrides."""
    parts = ["specc compile", shlex.quote(recipe["spec"]), *settings_of(recipe).command_flags()]
    for key, value in recipe.get("overrides", []):
        text = str(value).lower() if isinstance(value, bool) else str(value)
        parts.append(f"--set {shlex.quote(f'{key}={text}')}")
    return " ".join(parts)


def settings_of(recipe: dict) -> Settings:
    """The Settings of a recipe; a field it does not name keeps its default (folders compiled
    before the field existed)."""
    names = {f.name for f in fields(Settings)}
    return Settings(**{k: v for k, v in recipe.items() if k in names})


def overrides_of(recipe: dict) -> list:
    return [(key, value, Loc(f"--set {key}={value}")) for key, value in recipe.get("overrides", [])]


_HINT = "recompile it with `specc compile`"


def parse_generated(model_path: str) -> ast.Module:
    """A generated model.py's syntax tree, read without importing it; one located line if it is
    not Python."""
    try:
        with open(model_path, encoding="utf-8") as f:
            return ast.parse(f.read(), model_path)
    except SyntaxError as e:
        raise SpecError(Loc(model_path, e.lineno or 0, e.offset or 0), f"not a Python module: {e.msg}", _HINT) from None
    except (OSError, UnicodeDecodeError, ValueError, RecursionError) as e:
        raise SpecError(Loc(model_path), f"cannot read it as Python source ({getattr(e, 'strerror', None) or e})",
                        _HINT) from None


def read_recipe(model_path: str) -> dict:
    """SETTINGS of a generated model.py, read without importing it."""
    hint = _HINT
    tree = parse_generated(model_path)
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "SETTINGS" for t in node.targets):
            try:
                recipe = ast.literal_eval(node.value)
            except ValueError:
                recipe = None
            if not isinstance(recipe, dict) or not isinstance(recipe.get("spec"), str) \
                    or not isinstance(recipe.get("overrides", []), list):
                raise SpecError(Loc(model_path, node.lineno, node.col_offset + 1),
                                "SETTINGS does not record what this module was compiled from", hint)
            unknown = sorted(set(recipe) - {f.name for f in fields(Settings)} - {"spec", "overrides"})
            if unknown:
                raise SpecError(Loc(model_path, node.lineno, node.col_offset + 1),
                                f"SETTINGS has unknown keys {unknown}", hint)
            return recipe
    raise SpecError(Loc(model_path), "no SETTINGS in this generated module", hint)
