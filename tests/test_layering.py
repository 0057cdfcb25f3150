"""The layers, bottom up: `runtime/` (torch, imports no other package) and `specc/` (the
compiler, imports no torch and nothing else of ours); `specc_torch/`, what needs both (a model
built from a spec in memory, verify, the training launcher, Hugging Face conversion); `specc_cli/`,
the command line, on top. No package imports one above it, and no modules import each other in
a cycle.

The import graph is read from the sources with `ast`: every import statement counts, those inside
functions too (a lazy import is still a dependency), and relative imports are resolved."""

from __future__ import annotations

import ast
import os
import subprocess
import sys

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))
PACKAGES = ("specc", "runtime", "specc_torch", "specc_cli")


def _modules() -> dict:
    """{module name: (path, is_package)} for every .py under the packages."""
    out = {}
    for package in PACKAGES:
        top = os.path.join(ROOT, package)
        for dirpath, dirnames, filenames in os.walk(top):
            dirnames[:] = sorted(d for d in dirnames if d != "__pycache__")
            if "__init__.py" not in filenames:
                dirnames[:] = []  # not a package (e.g. templates): nothing below is importable as a module
                continue
            parts = os.path.relpath(dirpath, ROOT).split(os.sep)
            for name in sorted(filenames):
                if not name.endswith(".py"):
                    continue
                path = os.path.join(dirpath, name)
                if name == "__init__.py":
                    out[".".join(parts)] = (path, True)
                else:
                    out[".".join(parts + [name[:-3]])] = (path, False)
    return out


MODULES = _modules()


def _known(name: str) -> str:
    """The module an imported dotted name lands in: itself, or its longest known prefix (a name
    imported from a module), or the name itself when it is outside the packages."""
    parts = name.split(".")
    for i in range(len(parts), 0, -1):
        if ".".join(parts[:i]) in MODULES:
            return ".".join(parts[:i])
    return name


def _statements(module: str) -> list:
    """[(module named by the statement, [names imported from it] or None, line)] of every import
    statement in the module, at any depth, relative imports resolved."""
    path, is_package = MODULES[module]
    with open(path, encoding="utf-8") as f:
        tree = ast.parse(f.read(), path)
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(alias.name, None, node.lineno) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = module.split(".") if is_package else module.split(".")[:-1]
                base = base[:len(base) - (node.level - 1)]
                full = ".".join(base + ([node.module] if node.module else []))
            else:
                full = node.module
            out.append((full, [alias.name for alias in node.names], node.lineno))
    return out


def imports_of(module: str) -> list:
    """[(imported module, line)] of every import statement in the module, at any depth."""
    out = []
    for full, names, line in _statements(module):
        if names is None:
            out.append((_known(full), line))
            continue
        for name in names:
            target = f"{full}.{name}"  # `from pkg import submodule`
            out.append((target if target in MODULES else _known(full), line))
    return sorted(set(out), key=lambda item: (item[1], item[0]))


def _top(name: str) -> str:
    return name.split(".")[0]


def _where(module: str, line: int) -> str:
    return f"{os.path.relpath(MODULES[module][0], ROOT)}:{line}"


def _import_all_in_fresh_interpreter(prefix: str, forbidden: tuple) -> list:
    """Import every module of a package in a new interpreter; the forbidden top-level packages
    that ended up in sys.modules."""
    names = [m for m in MODULES if _top(m) == prefix]
    script = ("import importlib, sys\n"
              f"for name in {names!r}:\n"
              "    importlib.import_module(name)\n"
              f"print(sorted({{m for m in sys.modules if m.split('.')[0] in {forbidden!r}}}))\n")
    result = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    return ast.literal_eval(result.stdout.strip().splitlines()[-1])


# what each package may import of ours (the layers above it are missing)
MAY_IMPORT = {"runtime": {"runtime"}, "specc": {"specc"}, "specc_torch": {"runtime", "specc", "specc_torch"},
              "specc_cli": set(PACKAGES)}


def test_no_package_imports_a_layer_above_it():
    assert set(MAY_IMPORT) == set(PACKAGES)
    found = [f"{_where(m, line)}: {m} imports {target}" for m in MODULES
             for target, line in imports_of(m) if _top(target) in PACKAGES and _top(target) not in MAY_IMPORT[_top(m)]]
    assert not found, "an import upward (or sideways between runtime and specc):\n" + "\n".join(found)


def test_every_import_of_ours_names_a_module_that_exists():
    # a lazy import of a module that moved fails only when its function runs: not here
    missing = [f"{_where(m, line)}: {full}" for m in MODULES for full, _, line in _statements(m)
               if _top(full) in PACKAGES and full not in MODULES]
    assert not missing, "imports of modules that do not exist:\n" + "\n".join(missing)


def test_every_import_of_ours_in_tests_and_benches_resolves():
    # the tests and benches are outside the packages: a name they import from a module that moved
    # fails only when that file is collected or run
    import importlib

    missing = []
    for top in ("tests", "bench"):
        for dirpath, dirnames, filenames in os.walk(os.path.join(ROOT, top)):
            dirnames[:] = sorted(d for d in dirnames if not d.startswith(".") and d != "__pycache__")
            for name in sorted(f for f in filenames if f.endswith(".py")):
                path = os.path.join(dirpath, name)
                with open(path, encoding="utf-8") as f:
                    tree = ast.parse(f.read(), path)
                for node in ast.walk(tree):
                    if isinstance(node, ast.Import):
                        wanted = [(alias.name, None) for alias in node.names]
                    elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
                        wanted = [(node.module, alias.name) for alias in node.names]
                    else:
                        continue
                    for module, attr in wanted:
                        if _top(module) not in PACKAGES:
                            continue
                        where = f"{os.path.relpath(path, ROOT)}:{node.lineno}"
                        if module not in MODULES:
                            missing.append(f"{where}: {module}")
                        elif attr is not None and f"{module}.{attr}" not in MODULES and attr != "*" \
                                and not hasattr(importlib.import_module(module), attr):
                            missing.append(f"{where}: {module}.{attr}")
    assert not missing, "imports of names that do not exist:\n" + "\n".join(missing)


def test_importing_every_runtime_module_loads_no_specc():
    loaded = _import_all_in_fresh_interpreter("runtime", ("specc", "specc_torch", "specc_cli"))
    assert loaded == [], f"importing runtime's modules loaded {loaded}"


def test_specc_never_imports_torch():
    # In the sources, at any depth (the commands that run models reach torch through
    # specc_torch or runtime, imported when they run) ...
    found = [f"{_where(m, line)}: imports {target}" for m in MODULES if _top(m) == "specc"
             for target, line in imports_of(m) if _top(target) == "torch"]
    assert not found, "the compiler must not import torch:\n" + "\n".join(found)
    # ... and importing every module of the compiler loads neither torch nor what imports it.
    loaded = _import_all_in_fresh_interpreter("specc", ("torch", "runtime", "specc_torch", "specc_cli"))
    assert loaded == [], f"importing specc's modules loaded {[m for m in loaded if '.' not in m]}"


def strongly_connected_components(graph: dict) -> list:
    """Tarjan's algorithm, iterative; components in a deterministic order."""
    index, low, on_stack, stack, out = {}, {}, set(), [], []
    counter = 0
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                out.append(sorted(component))
    return out


def import_graph() -> dict:
    return {m: {t for t, _ in imports_of(m) if t in MODULES and t != m} for m in MODULES}


def test_no_modules_import_each_other_in_a_cycle():
    graph = import_graph()
    cycles = [c for c in strongly_connected_components(graph) if len(c) > 1]
    lines = []
    for component in cycles:
        members = set(component)
        lines.append("cycle through " + ", ".join(component) + ":")
        lines += [f"  {_where(m, line)}: {m} imports {t}" for m in component for t, line in imports_of(m)
                  if t in members and t != m]
    assert not cycles, "\n".join(lines)


def test_the_graph_sees_relative_and_function_level_imports():
    # the checks above are only as good as the graph: `from . import comm`, `from .x import y`,
    # `from .. import api`, and an import inside a function
    assert {"runtime.comm", "runtime.parallel_state"} <= import_graph()["runtime.grads"]
    assert {"runtime.optim", "runtime.train.config"} <= import_graph()["runtime.train.training"]
    assert "runtime.data" in import_graph()["specc_cli.data"]  # inside cmd_prepare
    assert strongly_connected_components({"a": {"b"}, "b": {"a", "c"}, "c": set()}) == [["c"], ["a", "b"]]
