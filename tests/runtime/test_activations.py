import math

import pytest
import torch

from runtime.activations import gelu, split, swiglu


def test_gelu_is_exact_erf_gelu():
    x = torch.linspace(-5, 5, 101, dtype=torch.float64)
    expected = torch.tensor([v * 0.5 * (1 + math.erf(v / math.sqrt(2))) for v in x.tolist()], dtype=torch.float64)
    torch.testing.assert_close(gelu(x), expected)


def test_swiglu_is_silu_gate_times_up():
    x = torch.randn(3, 2, 10, dtype=torch.float64)
    gate, up = x[..., :5], x[..., 5:]
    torch.testing.assert_close(swiglu(x), gate / (1 + torch.exp(-gate)) * up)
    with pytest.raises(ValueError, match="even last dim"):
        swiglu(torch.zeros(2, 3))


def test_split_last_dim_into_local_sizes():
    x = torch.arange(24.0).view(2, 12)
    q, k, v = split(x, [6, 3, 3])
    assert torch.equal(q, x[:, :6]) and torch.equal(k, x[:, 6:9]) and torch.equal(v, x[:, 9:])
    assert isinstance(split(x, [12]), tuple)
    with pytest.raises(ValueError, match=r"sum to 11, but the last dim is 12"):
        split(x, [6, 3, 2])
