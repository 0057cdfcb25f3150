"""The registry of op kinds a spec can name with `op:`."""

from .attention import CoreAttention
from .base import Attr, Ctx, LayoutRule, OpKind, Weight
from .boundary import BoundaryOp
from .elementwise import (
        Add,
        Clamp,
        Dropout,
        Geglu,
        Gelu,
        Glu,
        Mul,
        Reglu,
        Relu,
        Scale,
        Silu,
        Softcap,
        Split,
        SquaredRelu,
        Swiglu,
)
from .embedding import Embedding, PositionEmbedding
from .heads import Concat, ExpandHeads
from .linear import BiasAdd, Linear
from .loss import CrossEntropy
from .mamba import Mamba2Mixer
from .moe import MoE
from .norm import LayerNorm, RMSNorm
from .rotary import AttentionTemperature, Rotary

_ALL = (Linear(), BiasAdd(), Embedding(), PositionEmbedding(), LayerNorm(), RMSNorm(), Gelu(), Silu(), Swiglu(),
        Dropout(), Split(), Add(), Mul(), Rotary(), CoreAttention(), CrossEntropy(), BoundaryOp(),
        MoE(), Concat(), ExpandHeads(),
        Mamba2Mixer(), AttentionTemperature(),
        Relu(), SquaredRelu(), Glu(), Geglu(), Reglu(), Scale(), Softcap(), Clamp())
OPS = {op.name: op for op in _ALL}
# what a spec may name with `op:` (builtins come from `+` and `*`; bias_add is made by the compiler)
SPEC_OPS = {n: op for n, op in OPS.items() if not getattr(op, "builtin", False) and not getattr(op, "internal", False)}

__all__ = ["OPS", "SPEC_OPS", "Attr", "Ctx", "LayoutRule", "OpKind", "Weight"]
