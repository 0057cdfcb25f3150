"""specc runtime: what generated modules import to run tensor/sequence parallel.

The base layer: nothing here imports the compiler (specc) or specc_torch, the layer above both
that compiles specs in memory, verifies and launches training (tests/test_layering.py)."""

from .activation_recompute import recompute
from .activations import clamp, concat, expand_heads, gelu, glu, scale, softcap, split, squared_relu, swiglu
from .api import build_model
from .comm import CommCounter, CommRecord, all_gather_into_tensor, all_reduce, reduce_scatter_tensor
from .cross_entropy import vocab_parallel_cross_entropy
from .grads import finalize_model_grads, is_tp_partial_grad, mark_partial_grad, mark_tp_partial_grad, partial_grad_axes
from .init import ParamInit, full_parameter, gather_full, init_parameters, tag_parameter, tie_across_stages
from .layers import (
    ColumnParallelLinear,
    CoreAttention,
    Dropout,
    LayerNorm,
    PositionEmbedding,
    RMSNorm,
    RotaryEmbedding,
    RowParallelLinear,
    VocabParallelEmbedding,
)
from .mamba import Mamba2Mixer
from .mappings import (
    copy_to_tensor_model_parallel_region,
    gather_from_sequence_parallel_region,
    gather_from_tensor_model_parallel_region,
    reduce_from_tensor_model_parallel_region,
    reduce_scatter_to_sequence_parallel_region,
    scatter_to_sequence_parallel_region,
    scatter_to_tensor_model_parallel_region,
)
from .moe import MoELayer
from .parallel_state import Group, ProcessGroups
from .random import RNGTracker
from .rope import AttentionTemperature
from .te import TEColumnParallelLinear, TELayerNorm, TERMSNorm, TERowParallelLinear

__all__ = [
    "build_model",
    "TEColumnParallelLinear",
    "TERowParallelLinear",
    "TELayerNorm",
    "TERMSNorm",
    "Group",
    "ProcessGroups",
    "all_reduce",
    "all_gather_into_tensor",
    "reduce_scatter_tensor",
    "CommCounter",
    "CommRecord",
    "copy_to_tensor_model_parallel_region",
    "reduce_from_tensor_model_parallel_region",
    "gather_from_sequence_parallel_region",
    "reduce_scatter_to_sequence_parallel_region",
    "scatter_to_sequence_parallel_region",
    "gather_from_tensor_model_parallel_region",
    "scatter_to_tensor_model_parallel_region",
    "ColumnParallelLinear",
    "RowParallelLinear",
    "VocabParallelEmbedding",
    "PositionEmbedding",
    "LayerNorm",
    "RMSNorm",
    "RotaryEmbedding",
    "AttentionTemperature",
    "CoreAttention",
    "Dropout",
    "gelu",
    "swiglu",
    "glu",
    "squared_relu",
    "scale",
    "softcap",
    "clamp",
    "split",
    "concat",
    "expand_heads",
    "vocab_parallel_cross_entropy",
    "ParamInit",
    "tag_parameter",
    "init_parameters",
    "tie_across_stages",
    "full_parameter",
    "gather_full",
    "RNGTracker",
    "recompute",
    "mark_tp_partial_grad",
    "mark_partial_grad",
    "partial_grad_axes",
    "is_tp_partial_grad",
    "finalize_model_grads",
    "MoELayer",
    "Mamba2Mixer",
]

# Checkpoints (runtime.checkpoint), imported on first use: torch.distributed.checkpoint alone
# takes most of a second to import. (Hugging Face interop reads specs: specc_torch.hf.)
_LAZY = {
    "save_checkpoint": "checkpoint", "load_checkpoint": "checkpoint", "latest_step": "checkpoint",
    "CheckpointError": "checkpoint", "ParamShard": "checkpoint", "RankLocal": "checkpoint",
}
__all__ += list(_LAZY)


def __getattr__(name):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(f"{__name__}.{_LAZY[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

# Training pieces: data-parallel gradient buckets, the (distributed) optimizer and its LR schedule.
# The loop itself is runtime.train (setup_model_and_optimizer, train, train_step, evaluate); the
# launcher that compiles the spec and runs it is specc_torch.train.
from .ddp import DistributedDataParallel  # noqa: E402
from .optim import Adam, LRSchedule  # noqa: E402

__all__ += ["DistributedDataParallel", "Adam", "LRSchedule"]
