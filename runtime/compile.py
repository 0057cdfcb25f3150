"""torch.compile for generated modules, regionally: each repeated layer on its own, as torchtitan
does. Compiling the repeated block rather than the whole model keeps compile time flat in the
number of layers (the layers share one compiled graph: their parameters are graph inputs, not
constants) and leaves the embedding, the loss and everything outside the layers eager.

The collectives of a layer stay what the generated code says: TorchDynamo breaks the graph at a
process-group call it cannot trace, so the compiled regions are the computations between them,
and the runtime's CommCounter still counts every collective (specc verify compares them with the
plan under --torch-compile too).
"""

from __future__ import annotations

from torch import nn

BACKENDS = ("inductor", "aot_eager", "eager")


def repeated_layers(model: nn.Module) -> list:
    """(name, module) of every layer of every nn.ModuleList or nn.ModuleDict in the model (its
    repeated blocks; a pipeline stage keeps its layers in a ModuleDict keyed by global index)."""
    out = []
    for name, module in model.named_modules():
        inside = any(name.startswith(prefix + ".") for prefix, _ in out)  # a list inside a layer: compiled with it
        if isinstance(module, (nn.ModuleList, nn.ModuleDict)) and not inside:
            out += [(f"{name}.{key}" if name else str(key), layer) for key, layer in module.named_children()]
    return out


def compile_layers(model: nn.Module, backend: str = "inductor") -> int:
    """Compile every repeated layer in place (nn.Module.compile); returns how many. A model with no
    repeated layers is compiled whole. The parameters and their names do not change, so
    checkpoints, the optimizer and finalize_model_grads see the same model."""
    if backend not in BACKENDS:
        raise ValueError(f"torch.compile backend must be one of {', '.join(BACKENDS)}, got {backend!r}")
    layers = repeated_layers(model)
    if not layers:
        model.compile(backend=backend)
        return 1
    for _, layer in layers:
        layer.compile(backend=backend)
    return len(layers)


def is_compiled(module: nn.Module) -> bool:
    return getattr(module, "_compiled_call_impl", None) is not None


__all__ = ["BACKENDS", "compile_layers", "is_compiled", "repeated_layers"]
