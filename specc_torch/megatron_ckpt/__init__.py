"""Megatron Core checkpoints in and out: torch_dist (iter_N/ with DCP files, any TP/PP) and the
legacy per-rank model_optim_rng.pt, mapped through the spec's `megatron.checkpoint` block
(specc_torch/megatron_ckpt/convert.py, docs/checkpoints.md): the weights, and Adam's state
(moments, fp32 master weights, step count) where both sides have it."""

from .convert import export_megatron, import_megatron, read_weights
from .files import MegatronError, is_megatron_dir

__all__ = ["MegatronError", "export_megatron", "import_megatron", "is_megatron_dir", "read_weights"]
