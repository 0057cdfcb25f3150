"""The validated spec: plain dataclasses the rest of the compiler reads."""

from __future__ import annotations

from dataclasses import dataclass, field

from ..errors import Loc
from ..settings import Settings  # noqa: F401 (the settings a Spec holds; defined in specc/settings.py)


@dataclass
class Expr:
    """A dataflow expression: a variable, a call of a submodule, or a builtin (+, *)."""

    kind: str  # "var" | "call" | "add" | "mul"
    loc: Loc
    name: str = ""  # variable or callee
    args: list = field(default_factory=list)


@dataclass
class Step:
    targets: list  # variable names assigned ([] for return)
    expr: Expr | None
    returns: list  # names returned (return step only)
    text: str
    loc: Loc


@dataclass
class Leaf:
    """A submodule implemented by one op from the registry."""

    name: str
    op: str
    impl: str
    attrs: dict
    attr_locs: dict
    loc: Loc
    name_loc: Loc | None = None  # where the submodule is named
    attr_exprs: dict = field(default_factory=dict)  # attribute -> (its `${...}` source, its value) when one whole


@dataclass
class Ref:
    """A submodule that is another spec module, optionally repeated; or, with `layer_modules`, a
    repeated submodule whose layers are different modules (a hybrid pattern: module of layer i)."""

    name: str
    module: str  # the (first layer's) module
    repeat: int | None
    loc: Loc  # of the module name it refers to
    name_loc: Loc | None = None  # where the submodule is named
    layer_modules: tuple = ()  # per layer, its module (from `modules` and `pattern`); () when every layer is `module`
    module_locs: dict = field(default_factory=dict)  # module name -> where the spec names it

    def module_at(self, i: int) -> str:
        return self.layer_modules[i] if self.layer_modules else self.module

    def modules(self) -> list:
        """The modules it instantiates, each once, in order of first use."""
        return list(dict.fromkeys(self.layer_modules or (self.module,)))


@dataclass
class ModuleDef:
    name: str
    inputs: list
    submodules: dict  # name -> Leaf | Ref, in spec order
    steps: list
    returns: list
    loc: Loc
    description: str = ""
    recompute: str | None = None  # full | selective: every call of this module is recomputed in backward
    recompute_loc: Loc | None = None


@dataclass
class ModelInput:
    name: str
    shape: tuple
    dtype: str
    loc: Loc


@dataclass
class Spec:
    name: str
    path: str
    description: str
    config: dict
    modules: dict  # name -> ModuleDef
    root: str
    inputs: list  # ModelInput, in order of the root module's inputs
    settings: Settings
    source_hash: str
    hf: dict | None = None
    config_exprs: dict = field(default_factory=dict)  # config name -> its `${...}` source, when it is one whole
