"""The activations a spec may name, in one table: the plain ones (a standalone op, or the gate's
activation of a gated linear unit) and the gated ones (act(gate) * up over a last dim laid out
[gate | up], as an MoE's experts take them). The elementwise ops and the MoE op read their choices
here; the runtime holds the matching table (runtime/activations.py: the functions), and
tests/test_activation_registry.py checks the two name the same activations with the same gating.

Adding an activation: a line here, its function in runtime/activations.py (and, for a standalone
op of its own, an op class in elementwise.py)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Activation:
    name: str
    function: str = ""  # what generated code calls on one tensor (a plain activation's standalone op)
    gate: str = ""  # a gated unit: the plain activation applied to the gate half of [gate | up]

    @property
    def gated(self) -> bool:
        return bool(self.gate)


ACTIVATIONS = {a.name: a for a in (
    Activation("silu", "torch.nn.functional.silu"),
    Activation("gelu", "runtime.gelu"),
    Activation("gelu_tanh"),  # GELU's tanh approximation: the gelu op's approximate: tanh
    Activation("relu", "torch.nn.functional.relu"),
    Activation("squared_relu", "runtime.squared_relu"),
    Activation("swiglu", gate="silu"),
)}

PLAIN = tuple(n for n, a in ACTIVATIONS.items() if not a.gated)


def is_gated(name: str) -> bool:
    """Whether a projection feeding `name` is [gate | up], twice the width."""
    return ACTIVATIONS[name].gated
