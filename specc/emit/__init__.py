"""Emission: a typed op graph back to plain, readable PyTorch (like torch.fx's GraphModule.code)."""

from .emitter import emit_model

__all__ = ["emit_model"]
