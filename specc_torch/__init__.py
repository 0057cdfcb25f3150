"""The layer above the compiler (specc/, no torch) and the runtime (runtime/, no specc): what
needs both.

    specc_torch.api      compile_source, build_model: a model from a spec compiled in memory
    specc_torch.verify   `specc verify`: compiled models at TP/SP/CP settings against TP=1
    specc_torch.train    `specc train`'s launcher and `torchrun -m specc_cli.rank SPEC [flags]`
    specc_torch.hf       `specc hf import|export`, driven by the spec's `hf:` mapping

tests/test_layering.py checks the layering: runtime imports nothing from specc or specc_torch,
specc imports no torch, and no import cycle joins modules of different packages."""

__all__ = ["build_model", "compile_source", "import_hf", "export_hf"]

# Imported on first use: the API pulls in the runtime (torch and its models), which the rank
# launcher (`python -m specc_torch.torchrun`, a process per `specc train`) does not need, and Hugging
# Face interop (safetensors, torch.distributed.checkpoint).
_LAZY = {"build_model": "api", "compile_source": "api", "import_hf": "hf", "export_hf": "hf"}


def __getattr__(name):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(f"{__name__}.{_LAZY[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
