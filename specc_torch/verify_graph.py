"""What `specc verify` reads off a compiled graph: the model's inputs as the spec declares them
(drawn per step), the logits and the activation sites it compares, and each activation gathered
to its full shape from a rank's layout."""

from __future__ import annotations

import torch

from .verify_config import VerifyConfig

_TORCH_DTYPES = {"int64": torch.int64, "int32": torch.int32, "float32": torch.float32, "act": torch.float32}


def _data(cfg: VerifyConfig, inputs: list, step: int, dp_rank: int = 0) -> list:
    """One batch: a tensor per declared model input, in the forward's order (data-parallel rank
    `dp_rank`'s: each DP rank draws its own)."""
    g = torch.Generator().manual_seed(cfg.seed * 1000 + step + 1_000_003 * dp_rank)
    out = []
    for _name, shape, dtype, high in inputs:
        if high is None:
            out.append(torch.randn(shape, generator=g).to(dtype))
        elif high == DOCUMENTS:  # packed documents: each row cut at random points, unequal lengths
            starts = torch.rand(shape, generator=g) < 0.25
            starts[..., 0] = True
            out.append(starts.long().cumsum(-1).to(dtype))
        else:
            out.append(torch.randint(0, high, shape, generator=g).to(dtype))
    return out


def _model_inputs(spec, graph) -> list:
    """(name, shape, torch dtype, high) of every input the spec declares, in the root module's order.
    Integer inputs are drawn below `high`, the smallest range an op that indexes with them accepts:
    an embedding's rows, the cross-entropy's vocabulary (its logits' last dim) for its labels. An
    integer input no op indexes with (read for its shape, like positions) is drawn below its last
    dim, but attention's document ids as packed documents of random, unequal lengths (high is
    DOCUMENTS). Float inputs are drawn from a standard normal (verify runs in fp32)."""
    out = []
    for inp, value_id in zip(spec.inputs, graph.inputs):
        dtype = _TORCH_DTYPES[graph.values[value_id].dtype]
        high = None
        if not dtype.is_floating_point:
            bounds = _index_bounds(graph, value_id)
            high = min(bounds) if bounds else DOCUMENTS if _document_ids(graph, value_id) else inp.shape[-1]
        out.append((inp.name, tuple(inp.shape), dtype, high))
    return out


DOCUMENTS = "documents"


def _uses(graph, value_id: str):
    """(op, value) for every op reading the value, seen through layout conversions (a boundary's
    outputs are the same ids or tokens)."""
    todo, seen = [value_id], set()
    while todo:
        v = todo.pop()
        if v in seen:
            continue
        seen.add(v)
        for op in graph.users(v):
            if op.kind == "boundary":
                todo += op.outputs
            else:
                yield op, v


def _document_ids(graph, value_id: str) -> bool:
    """Does the input reach an attention's 4th input (document ids)?"""
    return any(op.kind == "core_attention" and op.inputs[3:] == [v] for op, v in _uses(graph, value_id))


def _index_bounds(graph, value_id: str) -> list:
    bounds = []
    for op, v in _uses(graph, value_id):
        if op.kind == "embedding":
            bounds.append(op.attrs["num_embeddings"])
        elif op.kind == "cross_entropy" and op.inputs[1] == v:
            bounds.append(graph.values[op.inputs[0]].shape[-1])
        elif op.kind == "position_embedding" and op.inputs[1:] == [v]:  # position ids: rows from the offset
            bounds.append(op.attrs["num_embeddings"] - op.attrs["offset"])
    return bounds


def _converts(graph, op_id) -> bool:
    from specc.ops import OPS

    return OPS[graph.ops[op_id].kind].converts()


def _site(graph, op) -> tuple:
    """How to gather an op's first output to full shape: (layout, segments, sequence dim, heads)."""
    value = graph.values[op.outputs[0]]
    segments = tuple(value.segments) or ((value.shape[-1],) if value.units and value.shape else ())
    return op.out_layouts[0], segments, value.seq_dim, value.units


def _holds_module(graph, op_id) -> bool:
    from specc.ops import OPS
    from specc.ops.base import OpKind

    return type(OPS[graph.ops[op_id].kind]).constructor is not OpKind.constructor


def _logits_module(graph):
    """The module that produces the logits (the first input of the cross-entropy), with its site:
    past conversions, and past ops that are function calls rather than modules (a soft cap on the
    output layer's logits), whose effect the loss and gradient rows still see."""
    for op in graph.iter_ops():
        if op.kind == "cross_entropy":
            producer = graph.values[op.inputs[0]].producer
            while producer and (_converts(graph, producer) or not _holds_module(graph, producer)):
                producer = graph.values[graph.ops[producer].inputs[0]].producer
            src = graph.ops.get(producer)
            if src is not None and src.attr_name:
                return (f"{src.scope}.{src.attr_name}" if src.scope else src.attr_name), _site(graph, src)
    return None, None


def _activation_sites(graph) -> list:
    """(module path, its output's site at each call) of every op that is a module, in execution
    order (a module called twice, as rotary on q and k, may get values sharded differently)."""
    sites: dict = {}
    for op in graph.iter_ops():
        if op.attr_name and not _converts(graph, op.id):
            path = f"{op.scope}.{op.attr_name}" if op.scope else op.attr_name
            sites.setdefault(path, []).append(_site(graph, op))
    return [(path, tuple(calls)) for path, calls in sites.items()]


def _full_activation(t, site, pg):
    """A rank's piece of a value gathered to full shape: over tp, then over cp (un-permuting the
    load-balanced chunks of the sequence)."""
    layout, segments, seq_dim, units = site
    full = _full_over_tp(t.detach().contiguous(), layout["tp"], segments, pg.tp, units)
    if pg.cp.size > 1 and layout["cp"] == "S(s)":
        from runtime.context_parallel import gather_load_balanced

        full = gather_load_balanced(full.contiguous(), pg.cp, seq_dim)
    return full


def _full_over_tp(t, layout, segments, tp, units=()):
    from runtime.init import segment_piece, unit_replicas
    from runtime.mappings import gather_dim0, gather_last

    if tp.size == 1 or layout in ("I", "R"):
        return t.clone()
    if layout == "S(s)":
        return gather_dim0(t, tp)
    if layout == "S(h)":
        full = gather_last(t, tp)
        segments = tuple(segments) or (full.shape[-1],)
        units = tuple(units) if len(units) == len(segments) else (0,) * len(segments)
        if len(segments) < 2 and not any(unit_replicas(u, tp.size) > 1 for u in units):
            return full
        # each rank holds a slice of every segment: regroup [q0 k0 v0 | q1 k1 v1] as [q0 q1 | k0 k1 | v0 v1],
        # taking a head replicated over ranks from its first replica
        local = [segment_piece(n, u, 0, tp.size)[1] for n, u in zip(segments, units)]
        per_rank = [c.split(local, dim=-1) for c in full.chunk(tp.size, dim=-1)]
        return torch.cat([per_rank[r][i] for i, u in enumerate(units)
                          for r in range(0, tp.size, unit_replicas(u, tp.size))], dim=-1)
    out = t.clone()  # P: the true value is the sum over ranks
    from runtime.comm import all_reduce
    all_reduce(out, tp)
    return out


def _capture(model, sites):
    """Forward hooks recording each op module's outputs (a list: a module may run twice)."""
    store, handles = {}, []
    for path, _ in sites:
        try:
            module = model.get_submodule(path)
        except AttributeError:
            continue
        def hook(m, i, o, path=path):
            if isinstance(o, torch.Tensor):
                store.setdefault(path, []).append(o)
        handles.append(module.register_forward_hook(hook))
    return store, handles


def _loss_and_returned(out):
    """A model returns its per-token loss, or the loss first and further values (the logits, for
    evaluation and generation), each already complete and replicated on every rank."""
    if isinstance(out, (tuple, list)):
        return out[0], [o.detach().clone() for o in out[1:]]
    return out, []
