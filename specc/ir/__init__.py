"""The op graph: every op of every layer, with the tensors between them."""

from .build import build_graph
from .graph import Graph, Op, Value

__all__ = ["Graph", "Op", "Value", "build_graph"]
