"""Backend resolution: each op's implementation, and why it was chosen."""

from __future__ import annotations

import importlib.util

from ..errors import Loc, SpecError
from ..ops import OPS

PACKAGES = {"te": "transformer_engine", "flash": "flash_attn"}
INSTALL = {"te": "pip install 'specc[te]' (transformer-engine[pytorch], needs CUDA)",
           "flash": "pip install 'specc[flash]' (flash-attn, needs CUDA)"}


def available(backend: str) -> bool:
    """Is a backend's package installed? Checked without importing it (imports are slow and
    need CUDA)."""
    pkg = PACKAGES.get(backend)
    return pkg is None or importlib.util.find_spec(pkg) is not None


def resolve(graph, settings, have=available, plan_only: bool = False) -> None:
    """Each op's implementation. plan_only (validate, plan, graph, diff: nothing is emitted to
    run): a backend asked for by name is planned even where its package is missing (a CPU box
    plans the production layout); `auto` still means what this machine has."""
    cache: dict = {}

    def have_cached(backend: str) -> bool:  # one importlib lookup per backend, not per op
        if backend not in cache:
            cache[backend] = have(backend)
        return cache[backend]

    for op in graph.iter_ops():
        kind = OPS[op.kind]
        requested = op.impl if op.impl not in ("", "auto") else settings.backend
        pinned = op.impl not in ("", "auto")
        where = op.attr_locs.get("impl", op.loc) if pinned else Loc("--backend")
        op.impl, op.impl_reason = _choose(kind, requested, pinned, where, op.id, have_cached, plan_only)
        if op.impl == "te" and op.attrs.get("tie"):  # te.Linear owns its weight: it cannot borrow one
            if pinned:
                raise SpecError(where, f"{op.id}: a layer with a tied weight cannot use impl 'te'",
                                "use impl: native (or auto) on it")
            op.impl, op.impl_reason = "native", "tied weight: te.Linear cannot share the embedding's weight"
        reason = kind.impl_unsupported(op.attrs, op.impl) or kind.inputs_unsupported(len(op.inputs), op.impl)
        if reason:
            if pinned:
                raise SpecError(where, f"{op.id}: impl '{op.impl}' {reason}", "use impl: native (or auto) on it")
            op.impl, op.impl_reason = "native", f"{op.impl} {reason}"
        op.attrs.update(kind.choices(op.attrs, settings, [graph.values[v].shape for v in op.inputs]))


def _choose(kind, requested: str, pinned: bool, where, op_id: str, have, plan_only: bool = False):
    source = "spec" if pinned else "--backend"
    if requested == "auto":
        for backend in ("te", "flash"):
            if backend in kind.impls and have(backend):
                return backend, f"auto: {PACKAGES[backend]} is installed"
        if any(b in kind.impls for b in PACKAGES):
            missing = " and ".join(PACKAGES[b] for b in PACKAGES if b in kind.impls)
            return "native", f"auto: {missing} not installed"
        return "native", "auto: only a native implementation"
    if requested not in kind.impls:
        if pinned:
            raise SpecError(where, f"{op_id}: op '{kind.name}' has no '{requested}' implementation")
        return "native", f"--backend {requested}: no {requested} implementation of {kind.name}"
    if requested in PACKAGES and not have(requested):
        if plan_only:
            return requested, f"{source}: {requested} (planned only: {PACKAGES[requested]} is not installed here)"
        raise SpecError(where, f"{op_id}: implementation '{requested}' was asked for but {PACKAGES[requested]} is not installed",
                        INSTALL[requested])
    return requested, f"{source}: {requested}"
