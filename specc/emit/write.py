"""Write a compiled spec to generated/NAME/ atomically, and check generated/ for staleness."""

from __future__ import annotations

import ast
import contextlib
import difflib
import os
import shutil
import tempfile

from ..errors import Loc, SpecError
from ..files import locked_folder, make_public, swap_folder
from ..graphviz import to_dot
from ..plan import build_plan, plan_json, plan_text
from .emitter import emit_model
from .recipe import parse_generated

FILES = ("model.py", "plan.txt", "plan.json", "graph.dot")
# Every folder compile writes holds MARKER: compile replaces only such folders (and only while they
# hold nothing but what it writes), never a user's folder or file of the same name.
MARKER = ".specc-output"
MARKER_TEXT = "written by `specc compile`; compiling to this folder again replaces it\n"
OWN = frozenset(FILES + ("__init__.py", MARKER, "__pycache__"))


def default_name(spec) -> str:
    s = spec.settings
    recompute = {None: "", "selective": "_recompute_selective"}.get(
        s.recompute_granularity, f"_recompute_{s.recompute_method}{s.recompute_num_layers}")
    return spec.name + (f"_tp{s.tp}" if s.tp > 1 else "") + ("_sp" if s.sp else "") + (f"_cp{s.cp}" if s.cp > 1 else "") \
        + (f"_ep{s.ep}" if s.ep > 1 else "") + recompute \
        + (f"_pp{s.pp}" if s.pp > 1 else "") + (f"_vpp{s.pp_virtual_stage_layers}" if s.pp_virtual_stage_layers else "")


def render_all(spec, graph, command: str, recipe: dict | None = None) -> dict:
    plan = build_plan(graph)
    return {"model.py": emit_model(graph, command, recipe), "plan.txt": plan_text(plan), "plan.json": plan_json(plan),
            "graph.dot": to_dot(graph)}


def compile_to_dir(spec, graph, root: str, command: str, name: str | None = None, recipe: dict | None = None) -> str:
    name = name or default_name(spec)
    if not name.isidentifier():
        raise SpecError(Loc("--name"), f"'{name}' is not a valid Python identifier", "the folder must be importable")
    target = os.path.join(root, name)
    try:  # refuse before the work when we can; the decision that counts is made under the lock
        check_replaceable(target)
    except SpecError:
        with _locked_if_exists(root):  # another writer may have been swapping the folder as we looked
            check_replaceable(target)
    files = render_all(spec, graph, command, recipe)  # everything rendered before anything is written
    return write_output(root, name, files)


@contextlib.contextmanager
def _locked_if_exists(root: str):
    if os.path.isdir(root):
        with locked_folder(root):
            yield
    else:
        yield


def write_output(root: str, name: str, files: dict) -> str:
    """Write `files` (and __init__.py and the marker) as ROOT/NAME, replacing a folder that specc
    wrote there before and nothing else. Concurrent writers of one ROOT take turns (a lock on
    ROOT); readers see the old folder or the new one, whole."""
    target = os.path.join(root, name)
    try:
        os.makedirs(root, exist_ok=True)
        with locked_folder(root):
            check_replaceable(target)
            tmp = tempfile.mkdtemp(dir=root, prefix=f".{name}.tmp-")
            try:
                make_public(tmp, 0o777)
                for fname, text in {**files, "__init__.py": "", MARKER: MARKER_TEXT}.items():
                    with open(os.path.join(tmp, fname), "w") as f:
                        f.write(text)
                swap_folder(tmp, target)
            except BaseException:
                shutil.rmtree(tmp, ignore_errors=True)
                raise
    except OSError as e:
        raise SpecError(None, f"cannot write {target}: {e.strerror or e}", "check the -o folder") from None
    return target


def check_replaceable(target: str) -> None:
    """Raise unless `target` is absent, an empty folder, or a folder specc compile wrote that
    holds nothing else. Written by specc: it holds MARKER, or (output of a specc from before the
    marker) a generated model.py and only files specc writes."""
    hint = "move it away, or write elsewhere with --name or -o"
    if not os.path.lexists(target):
        return
    if os.path.islink(target) or not os.path.isdir(target):
        raise SpecError(None, f"{target} exists and is not a folder that specc compile wrote", hint)
    try:
        entries = sorted(os.listdir(target))
    except OSError as e:
        raise SpecError(None, f"cannot read {target}: {e.strerror or e}", hint) from None
    if not entries:
        return
    if MARKER in entries:
        marked = _read(os.path.join(target, MARKER)) == MARKER_TEXT
    else:
        marked = set(entries) <= OWN and _generated_model(os.path.join(target, "model.py"))
    if not marked:
        raise SpecError(None, f"{target} is a folder that specc compile did not write (it has no {MARKER})", hint)
    foreign = [e for e in entries if e not in OWN]
    if foreign:
        raise SpecError(None, f"{target} holds {foreign[0]}, which specc compile did not write",
                        "move it out of the folder first: compiling replaces the whole folder")


def _read(path: str) -> str | None:
    try:
        with open(path, encoding="utf-8") as f:
            return f.read(4096)
    except (OSError, UnicodeDecodeError):
        return None


def _generated_model(path: str) -> bool:
    text = _read(path)
    if text is None or "\nGenerated by specc " not in text:
        return False
    try:
        compile_command_of(path)
    except (SpecError, SyntaxError, ValueError, OSError, UnicodeDecodeError):
        return False
    return True


def compile_command_of(model_path: str) -> str:
    """The COMPILE_COMMAND constant of a generated model.py, read without importing it."""
    for node in parse_generated(model_path).body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "COMPILE_COMMAND" for t in node.targets):
            if isinstance(node.value, ast.Constant) and isinstance(node.value.value, str):
                return node.value.value
    raise SpecError(Loc(model_path), "no COMPILE_COMMAND in this generated module", "recompile it with `specc compile`")


def check_generated(root: str, out) -> int:
    from ..pipeline import load_and_compile
    from .recipe import command_of, overrides_of, read_recipe, settings_of

    if not os.path.isdir(root):
        raise SpecError(Loc(root), "no such folder", "run `specc compile SPEC` first")
    stale, checked = 0, 0
    for name in sorted(os.listdir(root)):
        folder = os.path.join(root, name)
        model = os.path.join(folder, "model.py")
        if name.startswith(".") or not os.path.isfile(model):
            continue
        recipe = read_recipe(model)  # rebuilt from the recorded data, not from a command line
        spec, graph = load_and_compile(recipe["spec"], settings_of(recipe), overrides_of(recipe))
        fresh = render_all(spec, graph, command_of(recipe), recipe)
        checked += 1
        for fname, text in fresh.items():
            path = os.path.join(folder, fname)
            current = open(path, encoding="utf-8", errors="replace").read() if os.path.isfile(path) else ""
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
