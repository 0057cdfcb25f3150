import math

import pytest
import torch

from runtime.activations import gelu, glu, scale, softcap, split, squared_relu, swiglu


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


def test_gelu_tanh_is_gpt2_gelu_new():
    x = torch.linspace(-5, 5, 101, dtype=torch.float64)
    new = 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * torch.pow(x, 3.0))))
    torch.testing.assert_close(gelu(x, approximate="tanh"), new)
    assert (gelu(x, approximate="tanh") - gelu(x)).abs().max() > 1e-4  # not the erf form


def test_relu_family_and_gated_units():
    x = torch.randn(3, 2, 10, dtype=torch.float64)
    gate, up = x[..., :5], x[..., 5:]
    torch.testing.assert_close(squared_relu(x), torch.clamp(x, min=0) ** 2)
    cases = {"silu": gate * torch.sigmoid(gate), "relu": torch.clamp(gate, min=0),
             "squared_relu": torch.clamp(gate, min=0) ** 2, "gelu": gelu(gate),
             "gelu_tanh": gelu(gate, approximate="tanh")}
    for activation, act in cases.items():
        torch.testing.assert_close(glu(x, activation=activation), act * up)  # fused [gate | up]
        torch.testing.assert_close(glu(gate, up, activation=activation), act * up)  # separate gate, up
    with pytest.raises(ValueError, match="glu activation must be one of"):
        glu(x, activation="tanh")
    with pytest.raises(ValueError, match="even last dim"):
        glu(torch.zeros(2, 3), activation="relu")


def test_scale_rounds_the_factor_to_the_dtype_and_softcap_bounds():
    x = torch.randn(4, 8, dtype=torch.bfloat16)
    factor = math.sqrt(3072)  # 55.4256 in fp32, 55.5 in bf16 (Gemma's known rounding)
    assert torch.equal(scale(x, factor), x * torch.tensor(factor, dtype=torch.bfloat16))
    assert torch.equal(scale(x.float(), factor), x.float() * torch.tensor(factor, dtype=torch.float32))
    y = torch.linspace(-1000, 1000, 41, dtype=torch.float64)
    capped = softcap(y, 30.0)
    torch.testing.assert_close(capped, 30.0 * torch.tanh(y / 30.0))
    assert capped.abs().max() <= 30.0 and torch.allclose(softcap(y[20:21] + 0.01, 30.0), y[20:21] + 0.01, atol=1e-6)
