"""Hugging Face interop: `specc hf import|export` through safetensors, driven by the mapping a
spec declares under `hf:` (specc_torch/hf/mapping.py, docs/checkpoints.md)."""

from .convert import HFError, check_config, export_hf, import_hf, model_params, read_hf_config
from .mapping import Entry, Mapping, bind, mapping_of

__all__ = ["HFError", "Entry", "Mapping", "bind", "check_config", "export_hf", "import_hf", "mapping_of",
           "model_params", "read_hf_config"]
