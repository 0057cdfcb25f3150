"""TransformerEngine kernels behind specc's own layer contracts.

The plan's `te` implementation runs TE's GEMM and norm kernels (fused casts, fp8-ready) on the
local shards, while the layouts and every boundary stay exactly as the plan shows them: TE
modules are built without `parallel_mode`, and the column-parallel input copy or sequence gather
runs through runtime.mappings (visible, counted), not inside TE. Each class keeps the native
class's parameters (same names, shapes and TP-invariant init metadata) and hands them to the TE
module, so checkpoints and `specc verify` treat both implementations alike.

TransformerEngine is imported only when one of these classes is built: importing runtime never
needs it, and without it (or without CUDA) construction fails with one clear ImportError.
"""

from __future__ import annotations

import torch
from torch import nn

from . import mappings
from .layers import ColumnParallelLinear, LayerNorm, RMSNorm, RowParallelLinear


def import_te():
    try:
        import transformer_engine.pytorch as te
    except ImportError as e:
        raise ImportError(
            "this module was compiled with impl 'te', which needs NVIDIA TransformerEngine "
            "(pip install 'specc[te]') and a CUDA GPU; recompile with --backend native to run without it"
        ) from e
    return te


def _adopt(te_module: nn.Module, **params) -> nn.Module:
    """Make a TE module compute with our parameters (replacing the ones it allocated)."""
    for name, p in params.items():
        if p is None:
            continue
        if getattr(te_module, name, None) is None or tuple(getattr(te_module, name).shape) != tuple(p.shape):
            raise ValueError(f"TransformerEngine {type(te_module).__name__}.{name} does not match shape {tuple(p.shape)}")
        setattr(te_module, name, p)
    return te_module


class TEColumnParallelLinear(ColumnParallelLinear):
    """ColumnParallelLinear computing its local GEMM with te.Linear."""

    def __init__(self, in_features: int, out_features: int, **kwargs):
        if kwargs.get("weight") is not None:
            raise ValueError("a tied (shared) weight cannot be handed to te.Linear; pin impl: native on this layer")
        super().__init__(in_features, out_features, **kwargs)
        te = import_te()
        local = _adopt(te.Linear(in_features, self.weight.shape[0], bias=self.bias is not None,
                                 params_dtype=self.weight.dtype, device=self.weight.device),
                       weight=self.weight, bias=self.bias)
        object.__setattr__(self, "_te", local)  # not a submodule: the parameters stay registered here, once

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp.size > 1 and self.input_mode == "copy":
            x = mappings.copy_to_tensor_model_parallel_region(x, self.tp)
        elif self.tp.size > 1 and self.input_mode == "gather":
            x = mappings.gather_from_sequence_parallel_region(x, self.tp)
        return self._te(x)


class TERowParallelLinear(RowParallelLinear):
    """RowParallelLinear computing its local partial product with te.Linear (no bias: the
    generated code adds the bias after the reduction)."""

    def __init__(self, in_features: int, out_features: int, **kwargs):
        super().__init__(in_features, out_features, **kwargs)
        te = import_te()
        local = _adopt(te.Linear(self.weight.shape[1], out_features, bias=False, params_dtype=self.weight.dtype,
                                 device=self.weight.device), weight=self.weight)
        object.__setattr__(self, "_te", local)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._te(x)


class TELayerNorm(LayerNorm):
    def __init__(self, hidden_size: int, eps: float = 1e-5, *, zero_centered_gamma: bool = False):
        super().__init__(hidden_size, eps, zero_centered_gamma=zero_centered_gamma)
        te = import_te()
        object.__setattr__(self, "_te", _adopt(te.LayerNorm(hidden_size, eps=eps, zero_centered_gamma=zero_centered_gamma,
                                                            device=self.weight.device),
                                               weight=self.weight, bias=self.bias))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._te(x)


class TERMSNorm(RMSNorm):
    def __init__(self, hidden_size: int, eps: float = 1e-6, *, zero_centered_gamma: bool = False):
        super().__init__(hidden_size, eps, zero_centered_gamma=zero_centered_gamma)
        te = import_te()
        object.__setattr__(self, "_te", _adopt(te.RMSNorm(hidden_size, eps=eps, zero_centered_gamma=zero_centered_gamma,
                                                          device=self.weight.device),
                                               weight=self.weight))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._te(x)
