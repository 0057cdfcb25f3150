"""The validated spec: plain dataclasses the rest of the compiler reads."""

from __future__ import annotations

from dataclasses import dataclass, field

from ..errors import Loc


@dataclass(frozen=True)
class Settings:
    """Parallel and size settings that come from the command line, not the spec."""

    tp: int = 1
    sp: bool = False
    backend: str = "auto"  # default implementation for ops that say `impl: auto`
    micro_batch_size: int = 1
    dtype: str = "bf16"  # activation / parameter dtype used for bytes and memory
    fuse: bool = True  # let implementations absorb adjacent boundaries
    cp: int = 1  # context-parallel size: the sequence sharded over cp ranks outside attention
    cp_comm_type: str = "auto"  # attention over CP: p2p (ring) | all_gather | auto (the cost model)
    ep: int = 1  # expert-model-parallel size: the experts split over ep of the data-parallel ranks
    # pipeline parallelism (specc/passes/pipeline.py): the root's repeated block cut into pp stages
    # per rank chunk; by the cost model unless Megatron's placement flags or a layout string say
    pp: int = 1
    pp_virtual_stage_layers: int | None = None  # --num-layers-per-virtual-pipeline-stage (interleaved)
    pp_first_stage_layers: int | None = None  # --decoder-first-pipeline-num-layers
    pp_last_stage_layers: int | None = None  # --decoder-last-pipeline-num-layers
    pp_layout: str | None = None  # --pipeline-model-parallel-layout, e.g. "Et*3|t*4|t*3L"
    # activation recompute, Megatron's flags: None | full (whole layers from their input) | selective
    # (the attention core); full: uniform (groups of num_layers layers) | block (the first num_layers)
    recompute_granularity: str | None = None
    recompute_method: str | None = None
    recompute_num_layers: int | None = None

    def describe(self) -> str:
        cp = f" cp={self.cp} cp_comm_type={self.cp_comm_type}" if self.cp > 1 else ""
        cp += f" ep={self.ep}" if self.ep > 1 else ""
        cp += f" pp={self.pp}" if self.pp > 1 else ""
        return (f"tp={self.tp}{cp} sp={'on' if self.sp else 'off'} backend={self.backend} "
                f"micro_batch_size={self.micro_batch_size} dtype={self.dtype} fuse={'on' if self.fuse else 'off'}"
                + self.describe_recompute())

    def describe_recompute(self) -> str:
        if self.recompute_granularity is None:
            return ""
        if self.recompute_granularity == "selective":
            return " recompute=selective"
        return f" recompute=full/{self.recompute_method}/{self.recompute_num_layers}"

    def as_dict(self) -> dict:
        """The settings as plain data (a generated folder's SETTINGS), in a fixed key order."""
        return {"tp": self.tp, "sp": self.sp, "backend": self.backend, "micro_batch_size": self.micro_batch_size,
                "dtype": self.dtype, "fuse": self.fuse, "cp": self.cp, "cp_comm_type": self.cp_comm_type,
                **({"ep": self.ep} if self.ep > 1 else {}),  # absent at 1: earlier folders read the same
                **{k: v for k, v in self.pipeline_dict().items() if v != PIPELINE_DEFAULTS[k]},
                **self.recompute_dict()}

    def recompute_dict(self) -> dict:
        """The recompute settings, only when recompute is on (folders compiled without it keep
        their SETTINGS)."""
        if self.recompute_granularity is None:
            return {}
        return {"recompute_granularity": self.recompute_granularity, "recompute_method": self.recompute_method,
                "recompute_num_layers": self.recompute_num_layers}

    def pipeline_dict(self) -> dict:
        """The pipeline settings (as_dict names them only where they differ from the defaults, so
        a PP=1 module's SETTINGS stays what it was before pipeline parallelism existed)."""
        return {"pp": self.pp, "pp_virtual_stage_layers": self.pp_virtual_stage_layers,
                "pp_first_stage_layers": self.pp_first_stage_layers,
                "pp_last_stage_layers": self.pp_last_stage_layers, "pp_layout": self.pp_layout}


PIPELINE_DEFAULTS = {"pp": 1, "pp_virtual_stage_layers": None, "pp_first_stage_layers": None,
                     "pp_last_stage_layers": None, "pp_layout": None}


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
