"""Graph IR: ops (nodes) and values (edges), in execution order, on a networkx DiGraph."""

from __future__ import annotations

from dataclasses import dataclass, field

import networkx as nx

from ..errors import Loc

DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2, "int64": 8, "int32": 4, "float32": 4}


@dataclass
class Value:
    id: str
    name: str  # the spec's variable name, used by the emitter
    shape: tuple
    dtype: str  # "act" (the model's activation dtype), "int64", "float32", ...
    producer: str | None  # op id; None for model inputs
    layout: str | None = None
    segments: tuple = ()  # last-dim segments (full sizes) of a fused weight's output

    def elt_bytes(self, act_dtype: str) -> int:
        return DTYPE_BYTES[act_dtype if self.dtype == "act" else self.dtype]


@dataclass
class Absorbed:
    """A boundary an implementation performs itself (e.g. the SP all-gather in a column GEMM)."""

    boundary: object  # layouts.Boundary
    mode: str  # runtime input_mode: "copy" | "gather"


@dataclass
class Op:
    id: str
    kind: str
    attrs: dict
    inputs: list
    outputs: list
    scope: str  # module instance path: "" is the root, "layers.0.mlp" a submodule
    module: str  # the spec module that scope instantiates
    attr_name: str | None  # the submodule's name in its module (leaf ops)
    step: int  # index of the spec step that made it
    loc: Loc
    impl: str = ""
    impl_reason: str = ""
    in_layouts: list = field(default_factory=list)
    out_layouts: list = field(default_factory=list)
    boundary: object = None  # layouts.Boundary, for kind "boundary"
    absorbed: list = field(default_factory=list)
    tied_to: str | None = None  # op id whose weight this op shares
    tied_expr: str = ""
    partial_grad: list = field(default_factory=list)  # weight names whose grads are TP-partial
    local_sections: list = field(default_factory=list)
    attr_locs: dict = field(default_factory=dict)  # spec locations of attributes, for errors

    @property
    def local_name(self) -> str:
        return self.id[len(self.scope) + 1:] if self.scope else self.id


class Graph:
    def __init__(self, spec):
        self.spec = spec
        self.nx = nx.DiGraph()
        self.ops: dict[str, Op] = {}
        self.order: list[str] = []
        self.values: dict[str, Value] = {}
        self.inputs: list[str] = []
        self.outputs: list[str] = []
        self.scopes: dict[str, str] = {"": spec.root}  # scope path -> module name
        self.repeats: dict[str, int] = {}  # scope of a repeated submodule -> count
        self.calls: dict[str, tuple] = {}  # module instance scope -> (argument value ids, returned value ids)
        self.call_names: dict[str, list] = {}  # module instance scope -> the caller's names for its results

    def caller_of(self, scope: str) -> str:
        """The scope whose forward makes the call of `scope` (a repeated group's instances are
        called by the group's caller)."""
        parent = scope.rsplit(".", 1)[0] if "." in scope else ""
        if parent in self.repeats:
            parent = parent.rsplit(".", 1)[0] if "." in parent else ""
        return parent

    def rebind(self, old: str, new: str, scope: str) -> None:
        """A value converted in `scope` replaces the original where it crosses module calls: as a
        return value of the calls that contain `scope`, as an argument of the others."""
        for callee, (args, outs) in self.calls.items():
            inside = callee == "" or scope == callee or scope.startswith(callee + ".")
            target = outs if inside else args
            target[:] = [new if v == old else v for v in target]

    def add_value(self, value: Value) -> Value:
        self.values[value.id] = value
        return value

    def add_op(self, op: Op, before: str | None = None) -> Op:
        self.ops[op.id] = op
        self.nx.add_node(op.id)
        if before is None:
            self.order.append(op.id)
        else:
            self.order.insert(self.order.index(before), op.id)
        for v in op.inputs:
            self._link(v, op.id)
        return op

    def _link(self, value_id: str, consumer: str) -> None:
        producer = self.values[value_id].producer
        if producer is not None:
            self.nx.add_edge(producer, consumer, value=value_id)

    def remove_op(self, op_id: str) -> None:
        self.nx.remove_node(op_id)
        self.order.remove(op_id)
        del self.ops[op_id]

    def replace_input(self, op: Op, index: int, value_id: str) -> None:
        old = op.inputs[index]
        op.inputs[index] = value_id
        producer = self.values[old].producer
        if producer is not None and old not in op.inputs and self.nx.has_edge(producer, op.id):
            self.nx.remove_edge(producer, op.id)
        self._link(value_id, op.id)

    def consumers(self, value_id: str) -> list:
        """The ops that read a value (and "<output>" if the model returns it)."""
        producer = self.values[value_id].producer
        if producer is None:
            users = [o for o in self.iter_ops() if value_id in o.inputs]
        else:
            users = [self.ops[s] for s in self.nx.successors(producer) if value_id in self.ops[s].inputs]
        return users + (["<output>"] if value_id in self.outputs else [])

    def iter_ops(self):
        return (self.ops[i] for i in self.order)

    def unique_id(self, base: str) -> str:
        if base not in self.ops:
            return base
        n = 2
        while f"{base}#{n}" in self.ops:
            n += 1
        return f"{base}#{n}"
