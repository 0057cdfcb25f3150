"""The compiler's activation table (specc/ops/activations.py) and the runtime's
(runtime/activations.py) name the same activations with the same gating, and each gated
function is its gate's plain activation times the up half."""

import torch

from runtime import activations as rt
from specc.ops import activations as sc


def test_compiler_and_runtime_name_the_same_activations():
    assert set(sc.ACTIVATIONS) == set(rt.ACTIVATIONS)
    assert set(sc.PLAIN) == set(rt.PLAIN)
    assert {n: a.gate for n, a in sc.ACTIVATIONS.items() if a.gated} == {n: g for n, (_, g) in rt.GATED.items()}


def test_gated_functions_and_zero_rows():
    torch.manual_seed(0)
    x = torch.randn(3, 8, dtype=torch.float64)
    for name, (fn, gate) in rt.GATED.items():
        assert torch.equal(fn(x), rt.glu(x, activation=gate)), name
    # the grouped experts pad with zero rows, which every activation must keep at zero
    for name, fn in rt.ACTIVATIONS.items():
        assert torch.count_nonzero(fn(torch.zeros(2, 4))) == 0, name
