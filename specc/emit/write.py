"""Write a compiled spec to generated/NAME/ atomically, and check generated/ for staleness."""

from __future__ import annotations

import ast
import difflib
import os
import shlex
import shutil
import tempfile

from ..errors import Loc, SpecError
from ..files import make_public
from ..graphviz import to_dot
from ..plan import build_plan, plan_json, plan_text
from .emitter import emit_model

FILES = ("model.py", "plan.txt", "plan.json", "graph.dot")


def default_name(spec) -> str:
    s = spec.settings
    return spec.name + (f"_tp{s.tp}" if s.tp > 1 else "") + ("_sp" if s.sp else "")


def render_all(spec, graph, command: str) -> dict:
    plan = build_plan(graph)
    return {"model.py": emit_model(graph, command), "plan.txt": plan_text(plan), "plan.json": plan_json(plan),
            "graph.dot": to_dot(graph)}


def compile_to_dir(spec, graph, root: str, command: str, name: str | None = None) -> str:
    name = name or default_name(spec)
    if not name.isidentifier():
        raise SpecError(Loc("--name"), f"'{name}' is not a valid Python identifier", "the folder must be importable")
    files = render_all(spec, graph, command)  # everything rendered before anything is written
    os.makedirs(root, exist_ok=True)
    target = os.path.join(root, name)
    tmp = tempfile.mkdtemp(dir=root, prefix=f".{name}.tmp-")
    make_public(tmp, 0o777)
    try:
        for fname, text in files.items():
            with open(os.path.join(tmp, fname), "w") as f:
                f.write(text)
        with open(os.path.join(tmp, "__init__.py"), "w") as f:
            f.write("")
        old = None
        if os.path.exists(target):
            old = tempfile.mkdtemp(dir=root, prefix=f".{name}.old-")
            os.rmdir(old)
            os.rename(target, old)
        os.rename(tmp, target)
        if old:
            shutil.rmtree(old, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return target


def compile_command_of(model_path: str) -> str:
    """The COMPILE_COMMAND constant of a generated model.py, read without importing it."""
    with open(model_path) as f:
        tree = ast.parse(f.read(), model_path)
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "COMPILE_COMMAND" for t in node.targets):
            if isinstance(node.value, ast.Constant) and isinstance(node.value.value, str):
                return node.value.value
    raise SpecError(Loc(model_path), "no COMPILE_COMMAND in this generated module", "recompile it with `specc compile`")


def check_generated(root: str, out) -> int:
    from ..cli import build_parser, command_line, compile_args

    if not os.path.isdir(root):
        raise SpecError(Loc(root), "no such folder", "run `specc compile SPEC` first")
    stale, checked = 0, 0
    for name in sorted(os.listdir(root)):
        folder = os.path.join(root, name)
        model = os.path.join(folder, "model.py")
        if name.startswith(".") or not os.path.isfile(model):
            continue
        words = shlex.split(compile_command_of(model))
        args = build_parser().parse_args(words[1:])
        spec, graph = compile_args(args)
        fresh = render_all(spec, graph, command_line(args))
        checked += 1
        for fname, text in fresh.items():
            path = os.path.join(folder, fname)
            current = open(path).read() if os.path.exists(path) else ""
            if current != text:
                stale += 1
                out.writelines(difflib.unified_diff(current.splitlines(True), text.splitlines(True),
                                                    f"{path} (committed)", f"{path} (compiled now)"))
    if not checked:
        raise SpecError(Loc(root), "holds no generated modules", "run `specc compile SPEC -o " + root + "`")
    summary = f"{checked} generated module(s) checked, {stale} stale file(s)"
    out.write(summary + "\n")
    if stale:
        out.write("generated/ is stale: recompile with the command in each model.py's COMPILE_COMMAND\n")
    return 1 if stale else 0
