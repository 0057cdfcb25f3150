"""The op graph as Graphviz dot: ops as boxes, boundaries as orange diamonds naming their
collective, edges labelled with layouts, one cluster per module instance, each submodule's cluster
nested inside its parent's."""

from __future__ import annotations

import os
import shutil
import subprocess

from .errors import Loc, SpecError
from .files import atomic_write_text, check_replaceable
from .ops import OPS


def _q(text: str) -> str:
    """A dot string: quotes and backslashes escaped, newlines as dot's line breaks."""
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") + '"'


def to_dot(graph) -> str:
    active = bool(graph.mesh.active)
    lines = [f"digraph {_q(graph.spec.name)} {{", "  rankdir=TB;", '  node [fontname="Helvetica", fontsize=10];',
             '  edge [fontname="Helvetica", fontsize=8];']
    for vid in graph.inputs:
        lines.append(f"  {_q('input:' + vid)} [shape=oval, label={_q(vid)}];")
    by_scope: dict = {}
    order: list = []  # scopes, each after its ancestors, in the order their first op appears
    known: set = set()  # the same scopes: a set, so that thousands of layers stay linear
    for op in graph.iter_ops():
        by_scope.setdefault(op.scope, []).append(op)
        parts = op.scope.split(".") if op.scope else []
        for i in range(1, len(parts) + 1):
            prefix = ".".join(parts[:i])
            if prefix not in known and (prefix in graph.scopes or prefix == op.scope):
                order.append(prefix)
                known.add(prefix)

    def parent_of(scope: str) -> str:
        parts = scope.split(".")
        for i in range(len(parts) - 1, 0, -1):
            if ".".join(parts[:i]) in known:
                return ".".join(parts[:i])
        return ""

    children: dict = {}
    for scope in order:
        children.setdefault(parent_of(scope), []).append(scope)
    counter = [0]

    def emit(scope: str, indent: str) -> None:
        if scope:
            parent = parent_of(scope)
            name = scope[len(parent) + 1:] if parent else scope
            kind = graph.scopes.get(scope, "")
            lines.append(f"{indent[:-2]}subgraph {_q('cluster_' + str(counter[0]))} {{")
            counter[0] += 1
            lines.append(f"{indent}label={_q(name + (' (' + kind + ')' if kind else ''))}; style=rounded; color=gray; "
                         f"fontname=\"Helvetica\"; fontsize=9;")
        for op in by_scope.get(scope, []):
            _node(op, indent)
        for child in children.get(scope, []):
            emit(child, indent + "  ")
        if scope:
            lines.append(f"{indent[:-2]}}}")

    def _node(op, indent: str) -> None:
        kind = OPS[op.kind]
        if kind.converts():
            b = kind.boundary(op)
            label = f"{b.label}\n{b.function}\nfwd {b.forward or 'identity'} / bwd {b.backward or 'identity'}"
            lines.append(f"{indent}{_q(op.id)} [shape=diamond, style=filled, fillcolor=orange, label={_q(label)}];")
        else:
            extra = "".join(f"\n+ {a.boundary.function}" for a in op.absorbed)
            label = f"{op.local_name}\n{op.kind} [{op.impl}]{extra}"
            fill = "lightyellow" if op.absorbed else "white"
            lines.append(f"{indent}{_q(op.id)} [shape=box, style=filled, fillcolor={fill}, label={_q(label)}];")

    emit("", "  ")
    for op in graph.iter_ops():
        for vid in op.inputs:
            value = graph.values[vid]
            src = value.producer if value.producer else "input:" + vid
            label = str(value.layout) if active else ""
            lines.append(f"  {_q(src)} -> {_q(op.id)} [label={_q(label)}];")
    lines.append("}")
    return "\n".join(lines) + "\n"


def write_outputs(dot: str, path: str) -> list:
    """Write the .dot file (atomically) and, where Graphviz is installed, an SVG beside it."""
    out = [path]
    svg = os.path.splitext(path)[0] + ".svg" if path and shutil.which("dot") else None
    for target in (path, svg) if svg else (path,):  # both refused before either is written
        _check_target(target)
    _atomic_write(path, dot)
    if svg:
        result = subprocess.run(["dot", "-Tsvg", path], capture_output=True, text=True, check=False)
        if result.returncode != 0:
            raise SpecError(Loc(path), f"graphviz failed: {result.stderr.strip().splitlines()[-1] if result.stderr else 'no output'}")
        _atomic_write(svg, result.stdout)
        out.append(svg)
    return out


def _check_target(path: str) -> None:
    if not path:
        raise SpecError(Loc("-o"), "the output path is empty", "give the file to write, e.g. -o graph.dot")
    if os.path.isdir(path) and not os.path.islink(path):
        raise SpecError(Loc(path), "is a folder, not a file", "give the file to write, e.g. -o graph.dot")
    check_replaceable(path)  # a regular file or nothing: never a FIFO, a device or a link
    if not os.path.isdir(os.path.dirname(os.path.abspath(path))):
        raise SpecError(Loc(path), "output folder does not exist")


def _atomic_write(path: str, text: str) -> None:
    _check_target(path)
    try:
        atomic_write_text(path, text)
    except OSError as e:
        raise SpecError(Loc(path), f"cannot write it: {e.strerror or e}") from None
