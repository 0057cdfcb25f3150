"""The compile settings, defined once: every field of `Settings` declares its flags (Megatron's
name first, then an alias), its default, its rules (each a one-line error located at the flag),
its folder-name token and how `describe` prints it. Everything else is derived from this table:
the command line's flags (specc_cli/args.py), the compile command a generated folder records,
folder names, `describe`, SETTINGS in model.py and the plan, and the mesh the typing pass runs on.
The runtime keeps its own ParallelConfig (it may not import the compiler); a test checks that it
agrees with the parallel group here field by field (tests/specc_cli/test_settings_table.py)."""

from __future__ import annotations

import dataclasses
import re
import shlex
from dataclasses import dataclass
from typing import Callable

from .errors import Loc, SpecError
from .layouts import AXES, Mesh

GROUPS = ("parallel", "recompute", "compile")


@dataclass(frozen=True)
class Rule:
    """A combination that is an error: `broken(settings, value)`, reported at the field's flag
    (`at_value`: at "flag value") with `message` and `hint`, formatted with {value} and {s}.
    `flags_only`: a flag given to no effect, refused on the command line (check_flags) but
    harmless in a Settings built in code (sp at TP 1 types every value I)."""

    broken: Callable
    message: str
    hint: str = ""
    at_value: bool = False
    flags_only: bool = False


def at_least(n: int) -> Rule:
    return Rule(lambda s, v: v is not None and v < n, f"must be at least {n}, got {{value}}")


def needs(condition: Callable, message: str, hint: str = "", at_value: bool = False, flags_only: bool = True) -> Rule:
    """Given (not its default) only where `condition(settings)` holds."""
    return Rule(lambda s, v, _c=condition: v not in (None, False, "auto") and not _c(s), message, hint, at_value,
                flags_only)


@dataclass(frozen=True)
class Setting:
    """What a field declares besides its name and default."""

    group: str  # one of GROUPS
    flags: tuple  # Megatron's name first (errors name it), then aliases; a bool's flag flips its default
    help: str
    kind: type = int  # int | str | bool: the flag's type and the value's (None allowed when the default is)
    choices: tuple = ()
    metavar: str | None = None
    rules: tuple = ()  # Rule, checked in order after the kind and choices
    grammar: Callable | None = None  # value -> None, raising its own located error (a layout string)
    token: Callable | None = None  # settings -> the folder-name part ("" for none)
    show: Callable | None = None  # settings -> the describe() part (None: "name=value" when not the default)


def setting(default, group: str, flags: tuple, help: str, **kw):
    return dataclasses.field(default=default, metadata={"setting": Setting(group, tuple(flags), help, **kw)})


# -- the pipeline layout's grammar (a value of --pipeline-model-parallel-layout) ----------------------

LAYOUT_FLAG = "--pipeline-model-parallel-layout"
_LAYOUT_TOKEN = re.compile(r"\s*(E|L|t(?:\s*\*\s*(\d+))?)\s*")


def parse_layout(text: str) -> list:
    """`Et*3|t*4|t*3L` -> [(pre, layers, post)] per stage; a bad one is a one-line error."""
    loc = Loc(f"{LAYOUT_FLAG} {text}")
    stages = []
    for piece in text.split("|"):
        pos, pre, post, layers = 0, False, False, 0
        while pos < len(piece):
            m = _LAYOUT_TOKEN.match(piece, pos)
            if not m or m.end() == pos:
                bad = piece[pos:].strip()[:1] or piece[pos:pos + 1]
                raise SpecError(loc, f"unexpected {bad!r} in stage {len(stages)}",
                                "stages are split by |; E the embedding side, t a layer, t*N N layers, L the output")
            token = m.group(1)
            if token == "E":
                pre = True
            elif token == "L":
                post = True
            else:
                layers += int(m.group(2)) if m.group(2) else 1
            pos = m.end()
        stages.append((pre, layers, post))
    return stages


def _shown_if(name: str, test) -> Callable:
    return lambda s: f"{name}={getattr(s, name)}" if test(getattr(s, name)) else None


_NO_PP = needs(lambda s: s.pp > 1, "has no effect without pipeline parallelism",
               "add --pipeline-model-parallel-size N (N > 1), or drop it", flags_only=False)
_NOT_WITH_LAYOUT = Rule(lambda s, v: v is not None and s.pp_layout is not None,
                        f"conflicts with {LAYOUT_FLAG}, which places every layer itself", "give one of them")
_NOT_WITH_VIRTUAL = Rule(lambda s, v: v is not None and s.pp_virtual_stage_layers is not None,
                         "cannot be combined with --num-layers-per-virtual-pipeline-stage (every virtual stage "
                         "holds the same number of layers)", "give one of them")
_RECOMPUTE_FULL = (needs(lambda s: s.recompute_granularity is not None, "has no effect without "
                         "--recompute-granularity full", "add --recompute-granularity full, or drop it", True),
                   Rule(lambda s, v: v is not None and s.recompute_granularity == "selective",
                        "applies to --recompute-granularity full only (selective recomputes the attention core of "
                        "every layer)", "drop {flag}", True, flags_only=True))


def _recompute_token(s) -> str:
    if s.recompute_granularity is None:
        return ""
    if s.recompute_granularity == "selective":
        return "_recompute_selective"
    return f"_recompute_{s.recompute_method}{s.recompute_num_layers}"


def _recompute_shown(s) -> str | None:
    if s.recompute_granularity in (None, "selective"):
        return s.recompute_granularity and "recompute=selective"
    return f"recompute=full/{s.recompute_method}/{s.recompute_num_layers}"


@dataclass(frozen=True)
class Settings:
    """What the command line sets and the spec does not: the parallel layout, activation
    recompute, and how the compiler emits and sizes. A Settings is valid once built: its rules
    are checked in field order (a one-line error naming the flag); check_flags also refuses what
    flags cannot mean (a choice the flag does not offer, a flag given to no effect)."""

    # -- parallel -------------------------------------------------------------------------------
    tp: int = setting(1, "parallel", ("--tensor-model-parallel-size", "--tp"), "tensor-parallel size (default 1)",
                      metavar="N", rules=(at_least(1),), token=lambda s: f"_tp{s.tp}" if s.tp > 1 else "",
                      show=lambda s: f"tp={s.tp}")
    sp: bool = setting(False, "parallel", ("--sequence-parallel", "--sp"), "sequence parallelism in the regions "
                       "between tensor-parallel GEMMs (needs TP > 1)", kind=bool,
                       rules=(needs(lambda s: s.tp > 1, "needs --tensor-model-parallel-size 2 or more (sequence "
                                    "parallelism shards the sequence over the tensor-parallel ranks)",
                                    "add --tp N, or drop --sp"),),
                       token=lambda s: "_sp" if s.sp else "", show=lambda s: f"sp={'on' if s.sp else 'off'}")
    cp: int = setting(1, "parallel", ("--context-parallel-size", "--cp"), "context-parallel size: the sequence "
                      "sharded over N ranks in load-balanced chunks (default 1)", metavar="N", rules=(at_least(1),),
                      token=lambda s: f"_cp{s.cp}" if s.cp > 1 else "", show=_shown_if("cp", lambda v: v > 1))
    cp_comm_type: str = setting("auto", "parallel", ("--cp-comm-type",), "attention over the context-parallel "
                                "group: p2p (ring), all_gather, or auto (the cost model)", kind=str,
                                choices=("auto", "p2p", "all_gather"),
                                rules=(needs(lambda s: s.cp > 1, "has no effect without context parallelism",
                                             "add --context-parallel-size N, or drop --cp-comm-type"),),
                                show=lambda s: f"cp_comm_type={s.cp_comm_type}" if s.cp > 1 else None)
    ep: int = setting(1, "parallel", ("--expert-model-parallel-size", "--ep"), "expert-parallel size: the MoE "
                      "experts split over N of the data-parallel ranks (default 1)", metavar="N",
                      rules=(at_least(1), Rule(lambda s, v: v > 1 and s.cp > 1, "expert parallelism with context "
                                               "parallelism is not supported yet",
                                               "use --context-parallel-size 1 with expert parallelism")),
                      token=lambda s: f"_ep{s.ep}" if s.ep > 1 else "", show=_shown_if("ep", lambda v: v > 1))
    etp: int | None = setting(None, "parallel", ("--expert-tensor-parallel-size",), "tensor parallelism inside each "
                              "expert: equals --tensor-model-parallel-size here", metavar="N",
                              rules=(Rule(lambda s, v: v is not None and v != s.tp, "{value} differs from the "
                                          "tensor-model-parallel size {s.tp}: experts are sharded over the "
                                          "tensor-parallel ranks", "drop it, or give --expert-tensor-parallel-size "
                                          "{s.tp}"),))
    pp: int = setting(1, "parallel", ("--pipeline-model-parallel-size", "--pp"), "pipeline-parallel size: the "
                      "repeated layers cut into N stages (default 1)", metavar="N", rules=(at_least(1),),
                      token=lambda s: f"_pp{s.pp}" if s.pp > 1 else "", show=_shown_if("pp", lambda v: v > 1))
    pp_virtual_stage_layers: int | None = setting(
        None, "parallel", ("--num-layers-per-virtual-pipeline-stage",), "interleaved pipeline: N layers per "
        "model chunk, num_layers / (PP * N) chunks per rank", metavar="N", rules=(_NO_PP, at_least(1)),
        token=lambda s: f"_vpp{s.pp_virtual_stage_layers}" if s.pp_virtual_stage_layers else "")
    pp_first_stage_layers: int | None = setting(
        None, "parallel", ("--decoder-first-pipeline-num-layers",), "layers on the first pipeline stage (the rest "
        "split evenly)", metavar="N", rules=(_NO_PP, at_least(1), _NOT_WITH_LAYOUT, _NOT_WITH_VIRTUAL))
    pp_last_stage_layers: int | None = setting(
        None, "parallel", ("--decoder-last-pipeline-num-layers",), "layers on the last pipeline stage (the rest "
        "split evenly)", metavar="N", rules=(_NO_PP, at_least(1), _NOT_WITH_LAYOUT, _NOT_WITH_VIRTUAL))
    pp_layout: str | None = setting(
        None, "parallel", (LAYOUT_FLAG,), "layers per stage by hand: stages split by |, E the embedding side, t a "
        "layer (t*3: three), L the output and loss; e.g. 'Et*3|t*4|t*4|t*3L'", kind=str, metavar="LAYOUT",
        rules=(_NO_PP,), grammar=parse_layout)
    # -- activation recompute (Megatron's flags) -----------------------------------------------
    recompute_granularity: str | None = setting(
        None, "recompute", ("--recompute-granularity",), "full: recompute whole layers from their input in "
        "backward; selective: recompute the attention core (its s x s scores are not kept)", kind=str,
        choices=("full", "selective"),
        rules=(Rule(lambda s, v: v == "full" and s.recompute_method is None, "needs --recompute-method uniform or "
                    "block", "uniform: groups of --recompute-num-layers layers; block: the first N layers only",
                    True, flags_only=True),), token=_recompute_token, show=_recompute_shown)
    recompute_method: str | None = setting(
        None, "recompute", ("--recompute-method",), "with full: uniform (checkpoint groups of "
        "--recompute-num-layers consecutive layers) or block (recompute only the first --recompute-num-layers "
        "layers)", kind=str, choices=("uniform", "block"), rules=_RECOMPUTE_FULL, show=lambda s: None)
    recompute_num_layers: int | None = setting(
        None, "recompute", ("--recompute-num-layers",), "with full: layers per recomputed group (uniform) or "
        "layers recomputed (block); default 1", metavar="N",
        rules=_RECOMPUTE_FULL + (Rule(lambda s, v: v is not None and v < 1, "must be at least 1", at_value=True),),
        show=lambda s: None)
    # -- how the compiler emits and sizes ------------------------------------------------------------
    backend: str = setting("auto", "compile", ("--backend",), "implementation for ops that say impl: auto "
                           "(default auto: TransformerEngine where installed)", kind=str,
                           choices=("auto", "native", "te"), show=lambda s: f"backend={s.backend}")
    micro_batch_size: int = setting(1, "compile", ("--micro-batch-size",), "samples per forward on one rank (the plan's sizes)",
                                    metavar="B", rules=(at_least(1),),
                                    show=lambda s: f"micro_batch_size={s.micro_batch_size}")
    dtype: str = setting("bf16", "compile", ("--dtype",), "activation/parameter dtype for bytes", kind=str,
                         choices=("bf16", "fp16", "fp32"), show=lambda s: f"dtype={s.dtype}")
    fuse: bool = setting(True, "compile", ("--no-fuse",), "keep every boundary as its own call (no absorption "
                         "into GEMMs)", kind=bool, show=lambda s: f"fuse={'on' if s.fuse else 'off'}")
    # -- packed documents (Megatron's data flags): the model takes each token's position and document
    reset_position_ids: bool = setting(False, "compile", ("--reset-position-ids",), "the model takes position "
                                       "ids (input position_ids): positions restart at 0 after each end-of-document "
                                       "token (rotary and learned position embeddings)", kind=bool,
                                       token=lambda s: "_resetpos" if s.reset_position_ids else "")
    reset_attention_mask: bool = setting(False, "compile", ("--reset-attention-mask",), "the model takes document "
                                         "ids (input document_ids): attention stays within each document of a "
                                         "packed sample", kind=bool,
                                         token=lambda s: "_resetattn" if s.reset_attention_mask else "")

    def __post_init__(self):
        if self.recompute_granularity == "full" and self.recompute_num_layers is None:
            object.__setattr__(self, "recompute_num_layers", 1)  # Megatron's default under full
        for f, meta in TABLE:
            _check_field(self, f, meta, flags=False)

    def check_flags(self) -> Settings:
        """Every rule, as the command line applies them (settings_from); returns self."""
        for f, meta in TABLE:
            _check_field(self, f, meta, flags=True)
        return self

    @classmethod
    def names(cls, group: str) -> tuple:
        return tuple(f.name for f, meta in TABLE if meta.group == group)

    def group(self, group: str) -> dict:
        return {name: getattr(self, name) for name in self.names(group)}

    def as_dict(self) -> dict:
        """Every field, in table order: a generated folder's SETTINGS and the plan's."""
        return {f.name: getattr(self, f.name) for f, _ in TABLE}

    def describe(self) -> str:
        parts = [meta.show(self) if meta.show else _default_show(self, f) for f, meta in TABLE]
        return " ".join(p for p in parts if p)

    def folder_suffix(self) -> str:
        """The default generated folder's name after the spec's: `_tp2_sp_cp2`..."""
        return "".join(meta.token(self) for _, meta in TABLE if meta.token)

    def command_flags(self) -> list:
        """The `specc compile` flags that give these settings (shell-quoted), each field by its
        shortest flag, only where it is not the default."""
        out = []
        for f, meta in TABLE:
            value = getattr(self, f.name)
            if value == f.default:
                continue
            flag = SHORT_FLAG[f.name]
            out.append(flag if meta.kind is bool else f"{flag} {shlex.quote(str(value))}")
        return out

    def mesh(self) -> Mesh:
        """The mesh the graph is typed on: the size of every axis of layouts.AXES."""
        return Mesh.of(**{axis: getattr(self, axis) for axis in AXES})


TABLE = tuple((f, f.metadata["setting"]) for f in dataclasses.fields(Settings))
FLAG = {f.name: meta.flags[0] for f, meta in TABLE}  # the name errors give each setting
SHORT_FLAG = {f.name: min(meta.flags, key=len) for f, meta in TABLE}  # the one commands are written with


def _default_show(s, f) -> str | None:
    value = getattr(s, f.name)
    return None if value == f.default else f"{f.name}={value}"


def _check_field(s, f, meta: Setting, flags: bool) -> None:
    """Code may use values no flag offers (backend unfused or flash), not values of another kind."""
    value, flag = getattr(s, f.name), meta.flags[0]
    if value is None and f.default is None:
        return _check_rules(s, value, flag, meta, flags)
    ok = isinstance(value, bool) if meta.kind is bool else isinstance(value, meta.kind) and not isinstance(value, bool)
    if not ok:
        raise SpecError(Loc(flag), f"must be {_KIND_TEXT[meta.kind]}, got {value!r}")
    if flags and meta.choices and value not in meta.choices:
        raise SpecError(Loc(flag), f"must be one of {', '.join(meta.choices)}, got {value!r}")
    _check_rules(s, value, flag, meta, flags)
    if meta.grammar is not None:
        meta.grammar(value)


_KIND_TEXT = {int: "an integer", str: "a string", bool: "true or false"}


def _check_rules(s, value, flag: str, meta: Setting, flags: bool) -> None:
    for rule in meta.rules:
        if (flags or not rule.flags_only) and rule.broken(s, value):
            raise SpecError(Loc(f"{flag} {value}" if rule.at_value else flag),
                            rule.message.format(value=value, s=s, flag=flag), rule.hint.format(value=value, s=s, flag=flag))
