"""How `specc verify` compares a sharded run with its reference: the tolerances applied per
quantity, and the Row each comparison gives."""

from __future__ import annotations

import torch

from .verify_config import Row


def _compare(setting: str, ref: dict, got: dict, tol: float, atol: float) -> list:
    rows = [_row(setting, "loss (every step)", got["loss"], ref["loss"], tol, atol)]
    if ref["logits"] is not None and got["logits"] is not None:
        rows.append(_row(setting, "logits", got["logits"], ref["logits"], tol, atol))
    for i, (r, g) in enumerate(zip(ref.get("returned", []), got.get("returned", []))):
        rows.append(_row(setting, f"returned value {i + 1} (as the model returns it)", g, r, tol, atol))
    rows.append(_compare_activations(setting, ref["activations"], got["activations"], tol, atol))
    for what in ("grads", "weights"):
        label = "gradients (all params)" if what == "grads" else f"weights after {ref['loss'].shape[0]} SGD steps"
        rows.append(_compare_named(setting, label, ref[what], got[what], tol, atol, passed_detail=""))
    if got.get("replicas"):  # every TP rank holding a replicated head holds the same gradient and weight
        def relative(name):
            full = got["weights"][name[:-len(" (weight)")]] if name.endswith(" (weight)") else got["grads"][name]
            return got["replicas"][name] / max(float(full.abs().max()), 1e-12)

        worst = max(got["replicas"], key=relative)
        rows.append(Row(setting, "replicated heads agree across TP ranks", got["replicas"][worst], relative(worst),
                        relative(worst) <= tol, f"{len(got['replicas'])} gradients and weights; worst {worst}"))
    return rows


def _compare_activations(setting, ref: dict, got: dict, tol: float, atol: float) -> Row:
    """Every op module's output, in execution order; names the first one that diverges."""
    worst_abs, worst_rel, first_bad = 0.0, 0.0, None
    for path, ref_outs in ref.items():
        for i, r in enumerate(ref_outs):
            outs = got.get(path, [])
            g = outs[i] if i < len(outs) else None
            if g is None or g.shape != r.shape:
                first_bad = first_bad or f"first diverging activation: {path} (missing or shape differs)"
                continue
            a, rel = _errors(g, r)
            worst_abs, worst_rel = max(worst_abs, a), max(worst_rel, rel)
            if first_bad is None and not _close(g, r, tol, atol):
                first_bad = f"first diverging activation: output of {path} (abs err {a:.2e}, rel err {rel:.2e})"
    return Row(setting, f"activations ({len(ref)} op outputs)", worst_abs, worst_rel, first_bad is None, first_bad or "")


def _close(got, ref, tol: float, atol: float) -> bool:
    diff = (got.double() - ref.double()).abs().max().item()
    return diff <= atol + tol * ref.double().abs().max().item()


def _errors(got, ref):
    diff = (got.double() - ref.double()).abs().max().item()
    scale = ref.double().abs().max().item() or 1.0
    return diff, diff / scale


def _row(setting, quantity, got, ref, tol, atol) -> Row:
    if got.shape != ref.shape:
        return Row(setting, quantity, float("inf"), float("inf"), False, f"shape {tuple(got.shape)} != {tuple(ref.shape)}")
    a, rel = _errors(got, ref)
    return Row(setting, quantity, a, rel, _close(got, ref, tol, atol))


def _statistical_row(setting: str, ref: torch.Tensor, got: torch.Tensor) -> Row:
    """Dropout on, different masks on each side: each token's expected loss must agree. The
    largest per-token z-score (difference of means over its standard error) must stay below 6,
    which chance exceeds with probability ~1e-7 per token."""
    n = ref.shape[0]
    diff = (got.mean(0) - ref.mean(0)).abs()
    se = ((ref.var(0) + got.var(0)) / n).sqrt().clamp_min(1e-6)
    z = (diff / se).max().item()
    return Row(setting, f"per-token loss with dropout ({n} masks each)", diff.max().item(),
               (diff / ref.mean(0).abs().clamp_min(1e-12)).max().item(), z < 6.0, f"max z-score {z:.2f} (limit 6)")


def _compare_named(setting, label, ref: dict, got: dict, tol, atol, passed_detail: str | None = None) -> Row:
    """One row for a set of named tensors (gradients, weights): the worst error and the first
    tensor that diverges; when all pass, `passed_detail` (default: how many were compared)."""
    worst, first_bad, abs_max = 0.0, None, 0.0
    for name, r in ref.items():
        g = got.get(name)
        if g is None or g.shape != r.shape:
            first_bad = first_bad or f"{name} (missing or shape {None if g is None else tuple(g.shape)} != {tuple(r.shape)})"
            worst = float("inf")
            continue
        a, rel = _errors(g, r)
        abs_max, worst = max(abs_max, a), max(worst, rel)
        if not _close(g, r, tol, atol) and first_bad is None:
            first_bad = f"first diverging parameter: {name} (abs err {a:.2e}, rel err {rel:.2e})"
    done = f"{len(ref)} tensors" if passed_detail is None else passed_detail
    return Row(setting, label, abs_max, worst, first_bad is None, first_bad or done)
