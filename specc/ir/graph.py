"""Graph IR: ops (nodes) and values (edges) in execution order, with torch.fx's bookkeeping.

The graph keeps the execution order itself (a doubly linked list of op ids, so inserting before
or after an op is O(1)), the users of every value (use-def chains), and the module-call bindings
the emitter needs. Passes change the graph only through these methods: `insert_op` (at the
`inserting_before` point), `replace_input`, `replace_all_uses_with`, `erase_op`; `lint()` checks
every invariant and runs after every pass in the tests."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

from ..errors import Loc
from ..layouts import DTYPE_BYTES, local_shape_dims

OUTPUT = "<output>"  # the pseudo-user of a value the model returns


@dataclass
class Value:
    id: str
    name: str  # the spec's variable name, used by the emitter
    shape: tuple
    dtype: str  # "act" (the model's activation dtype), "int64", "float32", ...
    producer: str | None  # op id; None for model inputs
    layout: object = None  # layouts.Layout
    segments: tuple = ()  # last-dim segments (full sizes) of a fused weight's output
    seq_dim: int | None = 0  # which dim is the sequence (0 for activations, 1 for [b, s] ids)
    # attention heads per segment of the last dim (one entry without segments; 0: not heads, or
    # unknown): a segment of fewer heads than TP ranks has each head replicated over ranks on S(h)
    units: tuple = ()

    def local_shape(self, layout=None) -> tuple:
        """The shape one rank holds of this value under `layout` (default its own)."""
        return local_shape_dims(self.shape, layout if layout is not None else self.layout, self.seq_dim,
                                self.segments, self.units)

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
    in_layouts: list = field(default_factory=list)  # layouts.Layout per input
    out_layouts: list = field(default_factory=list)
    absorbed: list = field(default_factory=list)
    tied_to: str | None = None  # op id whose weight this op shares
    partial_grads: dict = field(default_factory=dict)  # mesh axis -> weight names whose grads are partial there
    attr_locs: dict = field(default_factory=dict)  # spec locations of attributes, for errors
    attr_exprs: dict = field(default_factory=dict)  # attribute -> (its `${...}` source, value): Leaf.attr_exprs

    @property
    def local_name(self) -> str:
        return self.id[len(self.scope) + 1:] if self.scope else self.id

    @property
    def partial_grad(self) -> list:
        """Weight names whose gradients are partial over any axis, in a stable order."""
        names: list = []
        for axis in sorted(self.partial_grads):
            names += [n for n in self.partial_grads[axis] if n not in names]
        return names


class Graph:
    def __init__(self, spec):
        self.spec = spec
        self.ops: dict[str, Op] = {}
        self.values: dict[str, Value] = {}
        self.inputs: list[str] = []
        self.outputs: list[str] = []
        self.scopes: dict[str, str] = {"": spec.root}  # scope path -> module name
        self.repeats: dict[str, int] = {}  # scope of a repeated submodule -> count
        self.calls: dict[str, tuple] = {}  # module instance scope -> (argument value ids, returned value ids)
        self.call_names: dict[str, list] = {}  # module instance scope -> the caller's names for its results
        self._users: dict[str, dict] = {}  # value id -> {op id: None} (insertion-ordered set)
        self._next: dict = {None: None}  # linked list of op ids; None is the sentinel
        self._prev: dict = {None: None}
        self._insert_point = None  # op id new ops go before; None: the end
        self._id_counts: dict[str, int] = {}
        self._calls_of: dict[str, set] = {}  # value id -> call scopes that bind it
        self.pipeline = None  # passes.pipeline.Pipeline: the stages at PP > 1
        self.recompute = None  # passes.recompute.Recompute: what backward runs again (set by the last pass)

    # -- module calls ------------------------------------------------------------------------
    def set_call(self, scope: str, args: list, outs: list) -> None:
        self.calls[scope] = (list(args), list(outs))
        for v in list(args) + list(outs):
            self._calls_of.setdefault(v, set()).add(scope)

    def calls_binding(self, value_id: str) -> list:
        """The call scopes whose arguments or results include a value, sorted."""
        return sorted(self._calls_of.get(value_id, ()))

    def caller_of(self, scope: str) -> str:
        """The scope whose forward makes the call of `scope` (a repeated group's instances are
        called by the group's caller)."""
        parent = scope.rsplit(".", 1)[0] if "." in scope else ""
        if parent in self.repeats:
            parent = parent.rsplit(".", 1)[0] if "." in parent else ""
        return parent

    def is_instance(self, scope: str) -> bool:
        """One instance of a repeated module (`layers.3`); its results are named at the group call."""
        return "." in scope and scope.rsplit(".", 1)[0] in self.repeats

    def rebind(self, old: str, new: str, scope: str) -> None:
        """A value converted in `scope` replaces the original where it crosses module calls: as a
        return value of the calls that contain `scope`, as an argument of the others."""
        for callee in self.calls_binding(old):
            args, outs = self.calls[callee]
            inside = callee == "" or scope == callee or scope.startswith(callee + ".")
            target = outs if inside else args
            if old in target:
                target[:] = [new if v == old else v for v in target]
                self._calls_of.setdefault(new, set()).add(callee)
            if old not in args and old not in outs:
                self._calls_of[old].discard(callee)

    # -- values and ops ----------------------------------------------------------------------
    def add_value(self, value: Value) -> Value:
        if value.id in self.values:
            raise ValueError(f"value {value.id} already exists")
        self.values[value.id] = value
        self._users[value.id] = {}
        return value

    @contextlib.contextmanager
    def inserting_before(self, op_id: str | None):
        """New ops go before `op_id` (None: at the end) inside the block."""
        saved, self._insert_point = self._insert_point, op_id
        try:
            yield
        finally:
            self._insert_point = saved

    @contextlib.contextmanager
    def inserting_after(self, op_id: str):
        with self.inserting_before(self._next[op_id]):
            yield

    def insert_op(self, op: Op) -> Op:
        """Add `op` at the insertion point (the end, or where `inserting_before` says)."""
        if op.id in self.ops:
            raise ValueError(f"op {op.id} already exists")
        before = self._insert_point
        after = self._prev[before]
        self._next[after], self._prev[op.id], self._next[op.id], self._prev[before] = op.id, after, before, op.id
        self.ops[op.id] = op
        for v in op.inputs:
            self._users[v][op.id] = None
        return op

    def erase_op(self, op_id: str) -> None:
        """Remove an op whose results nobody uses."""
        op = self.ops[op_id]
        for v in op.outputs:
            if self._users[v] or v in self.outputs:
                raise ValueError(f"cannot erase {op_id}: its result {v} is still used")
        for v in op.inputs:
            self._users[v].pop(op_id, None)
        after, before = self._prev[op_id], self._next[op_id]
        self._next[after], self._prev[before] = before, after
        del self._next[op_id], self._prev[op_id], self.ops[op_id]

    def replace_input(self, op: Op, index: int, value_id: str) -> None:
        old = op.inputs[index]
        op.inputs[index] = value_id
        if old not in op.inputs:
            self._users[old].pop(op.id, None)
        self._users[value_id][op.id] = None

    def set_inputs(self, op: Op, value_ids: list) -> None:
        for v in op.inputs:
            self._users[v].pop(op.id, None)
        op.inputs = list(value_ids)
        for v in op.inputs:
            self._users[v][op.id] = None

    def replace_all_uses_with(self, old: str, new: str, where=None) -> list:
        """Every op reading `old` (and passing `where(op)`, if given) reads `new` instead; the ops
        changed. The model's outputs are not changed (they are not ops)."""
        changed = []
        for user in self.users(old):
            if where is not None and not where(user):
                continue
            for i, v in enumerate(user.inputs):
                if v == old:
                    self.replace_input(user, i, new)
            changed.append(user)
        return changed

    def users(self, value_id: str) -> list:
        """The ops that read a value, in the order they were connected."""
        return [self.ops[o] for o in self._users[value_id]]

    def consumers(self, value_id: str) -> list:
        """The ops that read a value, and OUTPUT if the model returns it."""
        return self.users(value_id) + ([OUTPUT] if value_id in self.outputs else [])

    def iter_ops(self):
        op_id = self._next[None]
        while op_id is not None:
            nxt = self._next[op_id]  # read before yielding: the caller may erase this op
            yield self.ops[op_id]
            op_id = nxt

    def iter_ops_reversed(self):
        op_id = self._prev[None]
        while op_id is not None:
            prv = self._prev[op_id]
            yield self.ops[op_id]
            op_id = prv

    def next_op(self, op: Op) -> str | None:
        return self._next[op.id]

    def unique_id(self, base: str) -> str:
        if base not in self.ops and base not in self.values:
            return base
        n = max(self._id_counts.get(base, 1), 1) + 1
        while f"{base}#{n}" in self.ops or f"{base}#{n}" in self.values:
            n += 1
        self._id_counts[base] = n
        return f"{base}#{n}"

    # -- invariants ----------------------------------------------------------------------------
    def lint(self) -> None:
        """Check every invariant the passes rely on; raise AssertionError naming the first broken one."""
        seen: set = set()
        defined = set(self.inputs)
        count = 0
        prev = None
        for op in self.iter_ops():
            count += 1
            assert self._prev[op.id] == prev, f"order links broken at {op.id}"
            prev = op.id
            assert op.id not in seen, f"op {op.id} appears twice in the order"
            seen.add(op.id)
            for v in op.inputs:
                assert v in self.values, f"{op.id} reads unknown value {v}"
                assert v in defined, f"{op.id} reads {v} before it is made"
                assert op.id in self._users[v], f"users of {v} miss {op.id}"
            for v in op.outputs:
                assert self.values[v].producer == op.id, f"value {v} names producer {self.values[v].producer}, not {op.id}"
                defined.add(v)
        assert count == len(self.ops), "ops missing from the execution order"
        for vid, users in self._users.items():
            for u in users:
                assert u in self.ops and vid in self.ops[u].inputs, f"stale user {u} of {vid}"
        for v in self.outputs:
            assert v in defined, f"model output {v} is never made"
        for scope, (args, outs) in self.calls.items():
            for v in args + outs:
                assert v in self.values, f"call {scope!r} binds unknown value {v}"
                assert scope in self._calls_of.get(v, ()), f"call index misses {v} in {scope!r}"
