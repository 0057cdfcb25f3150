"""Pipeline parallelism: cut the root module into stages at its repeated block's layer boundaries.

The root's ops before the repeated block (the embedding side: Megatron's pre_process) go to the
first stage, its ops after it (final norm, output layer, loss: post_process) to the last, and the
layers in between are split into contiguous runs, one per stage. With interleaving (V model
chunks per rank) there are PP·V stages; stage s runs on pipeline rank s mod PP as that rank's
chunk s // PP (torch.distributed.pipelining's loop order, Megatron's virtual stages).

Where the layers go, in order of precedence:
  * `--pipeline-model-parallel-layout`: by hand, e.g. `Et*3|t*4|t*4|t*3L` (stages split by `|`; `E`
    the embedding side, on the first stage; `t` one layer, `t*N` N of them; `L` the output side, on
    the last stage);
  * `--decoder-first-pipeline-num-layers` / `--decoder-last-pipeline-num-layers`: the first / last
    stage gets that many layers and the other stages split the rest evenly (Megatron's rule);
  * `--num-layers-per-virtual-pipeline-stage N`: N layers on every stage (Megatron's interleaving);
  * otherwise the cost model: each layer costs its ops' forward + backward FLOPs (the ops'
    `flops` contract), the first stage also pays the ops before the block and the last those after
    it (the output GEMM over the vocabulary), and the contiguous cut minimizing the most expensive
    stage wins (ties: the earliest stages take the fewer layers). With no FLOPs known, every layer
    costs one and the ends nothing.

The values that cross a cut are the repeated block's input (the residual stream) at the layout
the typing pass gave it (sequence-sharded with SP or CP): that is the point-to-point traffic, in
each stage's `recv`/`send`. A spec with no repeated block at its root, a block that takes more
than one value, or a value of the embedding side read after the block cannot be cut: one located
error each. A weight tied between the two ends (word embedding and output layer) becomes one
weight per end stage, kept equal by an all-reduce of their gradients (`ties`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..errors import Loc, SpecError
from ..ops import OPS
from ..ops.base import numel
from ..settings import FLAG, parse_layout

_FLAGS = {"virtual": FLAG["pp_virtual_stage_layers"], "first": FLAG["pp_first_stage_layers"],
          "last": FLAG["pp_last_stage_layers"], "layout": FLAG["pp_layout"], "pp": FLAG["pp"]}


@dataclass(frozen=True)
class P2P:
    """A tensor one stage sends the next per micro-batch (and receives its gradient back)."""

    name: str  # the value's name in the root module's forward
    shape: tuple  # local shape on one rank
    layout: str
    dtype: str
    bytes: int


@dataclass(frozen=True)
class Stage:
    index: int
    rank: int  # pipeline rank
    chunk: int  # the rank's model chunk (interleaved: 0 .. V-1)
    layers: tuple  # global layer indices
    pre_process: bool  # runs the root's ops before the repeated block
    post_process: bool  # runs the root's ops after it
    recv: tuple = ()  # P2P from the stage before
    send: tuple = ()  # P2P to the stage after
    cost: int = 0  # forward + backward FLOPs of one micro-batch (0: unknown)


@dataclass
class Pipeline:
    size: int  # PP
    virtual: int  # V chunks per rank
    block: str  # the repeated block's scope (`layers`)
    num_layers: int
    stages: list
    placement: str  # how the layers were placed, for the plan
    ties: list = field(default_factory=list)  # (owner parameter name, copy's op id)

    def stage_of_scope(self, scope: str) -> int:
        """The stage an op of `scope` runs on."""
        if scope == self.block or scope.startswith(self.block + "."):
            index = int(scope[len(self.block) + 1:].split(".", 1)[0])
            return self._layer_stage[index]
        return -1

    def __post_init__(self):
        self._layer_stage = {i: s.index for s in self.stages for i in s.layers}


# -- the cut -----------------------------------------------------------------------------------------

def cut_pipeline(graph, settings) -> Pipeline | None:
    """The stages of a typed graph at settings.pp; None at PP=1. Sets graph.pipeline."""
    graph.pipeline = None  # the flags were checked when the Settings were made (specc/settings.py)
    if settings.pp == 1:
        return None
    spec = graph.spec
    root = spec.modules[spec.root]
    blocks = [s for s in graph.repeats if "." not in s]
    if not blocks:
        raise SpecError(root.loc, f"pipeline parallelism cuts the root module {spec.root} at a repeated block "
                        f"(a submodule with repeat:), and it has none",
                        "give the layers as one repeated submodule, or drop --pipeline-model-parallel-size")
    if len(blocks) > 1:
        raise SpecError(root.loc, f"pipeline parallelism cuts the root module at one repeated block; "
                        f"{spec.root} has {len(blocks)} ({', '.join(blocks)})", "drop --pipeline-model-parallel-size")
    block = blocks[0]
    n = graph.repeats[block]
    args, outs = graph.calls[block]
    side = [v for v in args[1:] if v not in graph.inputs]  # model inputs reach every stage as they are
    if len(outs) != 1 or side:
        raise SpecError(root.loc, f"pipeline stages pass one value from layer to layer; the repeated block "
                        f"{block} takes {len(args)} and returns {len(outs)}"
                        + (f", and {', '.join(graph.values[v].name for v in side)} besides the model's inputs"
                           if side else ""), "drop --pipeline-model-parallel-size")
    pp, virtual = settings.pp, 1
    if settings.pp_virtual_stage_layers is not None:
        per = settings.pp_virtual_stage_layers
        if n % (pp * per) != 0:
            raise SpecError(Loc(_FLAGS["virtual"]), f"{per} layers per virtual stage do not divide {n} layers "
                            f"over {pp} pipeline ranks evenly (num_layers must be a multiple of PP * {per})")
        virtual = n // (pp * per)
    stages_n = pp * virtual

    pre_ops, post_ops, layer_cost = [], [], [0] * n
    seen_layer = False
    for op in graph.iter_ops():
        if op.scope == block or op.scope.startswith(block + "."):
            seen_layer = True
            layer_cost[int(op.scope[len(block) + 1:].split(".", 1)[0])] += _flops(graph, op)
        elif seen_layer:
            post_ops.append(op)
        else:
            pre_ops.append(op)
    pre_cost = sum(_flops(graph, op) for op in pre_ops)
    post_cost = sum(_flops(graph, op) for op in post_ops)
    _check_crossing(graph, pre_ops, post_ops)

    if settings.pp_layout is not None:
        counts, placement = _from_layout(settings.pp_layout, stages_n, n), "by --pipeline-model-parallel-layout"
    elif settings.pp_first_stage_layers is not None or settings.pp_last_stage_layers is not None:
        counts = _first_last(settings.pp_first_stage_layers, settings.pp_last_stage_layers, stages_n, n)
        placement = "by --decoder-first/last-pipeline-num-layers, the rest evenly"
    elif settings.pp_virtual_stage_layers is not None:
        counts = [settings.pp_virtual_stage_layers] * stages_n
        placement = f"{settings.pp_virtual_stage_layers} layers per virtual stage"
    else:
        if n < stages_n:
            raise SpecError(Loc(_FLAGS["pp"]), f"{n} layers cannot be cut into {stages_n} pipeline stages of at "
                            f"least one layer each", "use fewer stages")
        if sum(layer_cost) == 0:
            costs, ends, placement = [1] * n, (0, 0), "evenly (no FLOPs known)"
        else:
            costs, ends, placement = layer_cost, (pre_cost, post_cost), "balanced by the cost model (FLOPs)"
        counts = _balance(costs, ends, stages_n)

    stages, start = [], 0
    for s, count in enumerate(counts):
        layers = tuple(range(start, start + count))
        start += count
        cost = sum(layer_cost[i] for i in layers) + (pre_cost if s == 0 else 0) + \
            (post_cost if s == stages_n - 1 else 0)
        carry = graph.values[args[0]].name  # the running value as the root's forward names it
        recv = (_p2p(graph, graph.calls[f"{block}.{layers[0]}"][0][0], carry, settings),) if s > 0 else ()
        send = (_p2p(graph, graph.calls[f"{block}.{layers[-1]}"][1][0], carry, settings),) if s < stages_n - 1 else ()
        stages.append(Stage(s, s % pp, s // pp, layers, s == 0, s == stages_n - 1, recv, send, cost))
    pipeline = Pipeline(pp, virtual, block, n, stages, placement, _ties(graph, pre_ops, post_ops))
    graph.pipeline = pipeline
    return pipeline


def _flops(graph, op) -> int:
    kind = OPS[op.kind]
    flops = getattr(kind, "flops", None)
    if flops is None:
        return 0
    values = graph.values
    local_in = [values[v].local_shape(lay) for v, lay in zip(op.inputs, op.in_layouts)]
    local_out = [values[v].local_shape(lay)
                 for v, lay in zip(op.outputs, op.out_layouts)]
    forward, backward = flops(op, local_in, local_out, graph.mesh)
    return int(forward) + int(backward)


def _check_crossing(graph, pre_ops, post_ops) -> None:
    """Only the block's input may leave the embedding side: anything else would have to travel
    through every middle stage."""
    made_before = {v for op in pre_ops for v in op.outputs}
    for op in post_ops:
        for v in op.inputs:
            if v in made_before:
                raise SpecError(op.loc, f"{graph.values[v].name} is made before the repeated block and read after "
                                f"it: a pipeline stage receives only the block's running value",
                                "compute it after the block, or drop --pipeline-model-parallel-size")


def _ties(graph, pre_ops, post_ops) -> list:
    """Weights shared across stages: the owner on the embedding side, the user after the block."""
    pre_ids, post_ids = {op.id for op in pre_ops}, {op.id for op in post_ops}
    out = []
    for op in graph.iter_ops():
        if not op.tied_to:
            continue
        if op.tied_to in pre_ids and op.id in post_ids:
            owner = graph.ops[op.tied_to]
            out.append((f"{owner.scope + '.' if owner.scope else ''}{owner.attr_name}.weight", op.id))
        elif not ({op.tied_to, op.id} <= pre_ids or {op.tied_to, op.id} <= post_ids):
            raise SpecError(op.loc, f"{op.id} shares its weight with {op.tied_to} across the repeated block's "
                            f"stages: pipeline stages share weights only between the embedding side (first "
                            f"stage) and the output side (last stage)", "drop the tie, or --pipeline-model-parallel-size")
    return out


def _p2p(graph, value_id: str, name: str, settings) -> P2P:
    v = graph.values[value_id]
    shape = v.local_shape()
    return P2P(name, tuple(shape), str(v.layout), v.dtype, numel(shape) * v.elt_bytes(settings.dtype))


def _balance(costs: list, ends: tuple, stages: int) -> list:
    """Layer counts per stage: contiguous, at least one layer each, minimizing the most expensive
    stage (the first also pays ends[0], the last ends[1]); ties go to fewer layers early."""
    n = len(costs)
    prefix = [0]
    for c in costs:
        prefix.append(prefix[-1] + c)

    def cost(s, i, j):  # stage s holding layers i..j-1
        return prefix[j] - prefix[i] + (ends[0] if s == 0 else 0) + (ends[1] if s == stages - 1 else 0)

    inf = float("inf")
    best = [[inf] * (n + 1) for _ in range(stages + 1)]
    best[0][0] = 0
    for s in range(1, stages + 1):
        for j in range(s, n - (stages - s) + 1):
            best[s][j] = min(max(best[s - 1][i], cost(s - 1, i, j)) for i in range(s - 1, j))
    target, counts, j = best[stages][n], [], n
    for s in range(stages, 0, -1):  # the later stages take as many layers as the optimum allows
        i = min(i for i in range(s - 1, j) if best[s - 1][i] <= target and cost(s - 1, i, j) <= target)
        counts.append(j - i)
        j = i
    return counts[::-1]


def _first_last(first, last, stages: int, n: int) -> list:
    fixed = (first or 0) + (last or 0)
    others = stages - (first is not None) - (last is not None)
    flag = _FLAGS["first"] if first is not None else _FLAGS["last"]
    if fixed > n or (others == 0 and fixed != n):
        raise SpecError(Loc(flag), f"places {fixed} of the {n} layers on {stages - others} stage(s), leaving "
                        f"{n - fixed} for {others} other stage(s)")
    if others and ((n - fixed) % others or n - fixed < others):
        raise SpecError(Loc(flag), f"the {n - fixed} layers left do not split evenly over the {others} other "
                        f"pipeline stage(s)", "choose first/last layer counts that leave a multiple")
    middle = (n - fixed) // others if others else 0
    counts = [middle] * stages
    if first is not None:
        counts[0] = first
    if last is not None:
        counts[-1] = last
    return counts


def _from_layout(text: str, stages: int, n: int) -> list:
    parsed = parse_layout(text)
    loc = Loc(f"{_FLAGS['layout']} {text}")
    if len(parsed) != stages:
        raise SpecError(loc, f"gives {len(parsed)} stage(s), the pipeline has {stages} (PP x virtual stages)")
    total = sum(layers for _, layers, _ in parsed)
    if total != n:
        raise SpecError(loc, f"places {total} layers, the spec has {n}")
    for s, (pre, layers, post) in enumerate(parsed):
        if pre != (s == 0):
            raise SpecError(loc, "E (the embedding side) belongs on the first stage, and only there")
        if post != (s == stages - 1):
            raise SpecError(loc, "L (the output layer and loss) belongs on the last stage, and only there")
        if layers < 1:
            raise SpecError(loc, f"stage {s} holds no layer", "give every stage at least one t")
    return [layers for _, layers, _ in parsed]


def bubble_fraction(pp: int, virtual: int, micro_batches: int) -> float:
    """Idle share of a (interleaved) 1F1B step: (P - 1) / (V·m + P - 1)."""
    return (pp - 1) / (virtual * micro_batches + pp - 1)


def in_flight(stage, pp: int, virtual: int, micro_batches: int) -> int:
    """Micro-batches whose activations a rank's stage holds at the schedule's peak. 1F1B: stage i
    runs P - i forwards before its first backward, so min(P - i, m). Interleaved (torch's
    ScheduleInterleaved1F1B): rank r warms up with (V - 1)·k + 2·(P - 1 - r) chunk forwards (k the
    micro-batches per round, P when m is a multiple of P) and holds one more at the first backward;
    counted here as that many chunks of its largest chunk (an upper bound)."""
    if virtual == 1:
        return min(pp - stage.rank, micro_batches)
    rounds = max(1, micro_batches // pp)
    per_round = micro_batches // rounds
    return min(micro_batches * virtual, (virtual - 1) * per_round + 2 * (pp - 1 - stage.rank) + 1)

