"""The pipeline cut (specc/passes/pipeline.py) and the plan's pipeline numbers, compiler only.

Every expected placement and number is derived here from the documented rule: the balancing rule
by brute force over every contiguous cut, the bubble (P - 1) / (V·m + P - 1) and the 1F1B peak
min(P - i, m) as exact fractions / integers."""

from __future__ import annotations

import itertools
from fractions import Fraction

import pytest

from specc.errors import SpecError
from specc.passes.pipeline import _balance, bubble_fraction, in_flight
from specc.plan.build import build_plan

# a tiny GPT: 8 layers, hidden 128, seq 128; every layer costs the same, the embedding side no
# FLOPs, the output side the vocabulary GEMM (6·b·s·h·V forward + backward)
TINY = {"num_layers": 8, "hidden_size": 128, "seq_length": 128, "vocab_size": 1024, "num_attention_heads": 4}


def _pipe(compiled, overrides=None, **settings):
    _, graph = compiled("gpt.yaml", overrides={**TINY, **(overrides or {})}, **settings)
    return graph.pipeline


def _counts(pipe):
    return [len(s.layers) for s in pipe.stages]


def _ends_and_layer(compiled, overrides):
    """The per-layer cost and the two ends' costs, read off a cut with one layer per stage."""
    pipe = _pipe(compiled, overrides, pp=overrides.get("num_layers", 8))
    costs = [s.cost for s in pipe.stages]
    layer = costs[1]
    assert all(c == layer for c in costs[1:-1])
    return layer, costs[0] - layer, costs[-1] - layer


def _brute_force(layer, pre, post, n, p):
    """The documented rule by enumeration: the contiguous cut (>= 1 layer each) minimizing the most
    expensive stage; ties: the earliest stages take the fewer layers (lexicographically smallest)."""
    best = None
    for cut in itertools.combinations(range(1, n), p - 1):
        counts = [b - a for a, b in zip((0,) + cut, cut + (n,))]
        cost = [c * layer for c in counts]
        cost[0] += pre
        cost[-1] += post
        key = (max(cost), counts)
        best = key if best is None or key < best else best
    return best[1]


def test_pipeline_off_at_pp1(compiled):
    assert _pipe(compiled) is None


@pytest.mark.parametrize("vocab", [1024, 8192])
@pytest.mark.parametrize("pp", [2, 4])
def test_balance_matches_the_rule(compiled, pp, vocab):
    layer, pre, post = _ends_and_layer(compiled, {"vocab_size": vocab})
    h, s = TINY["hidden_size"], TINY["seq_length"]
    assert pre == 0 and post == 6 * s * h * vocab  # the embedding is a gather; the output GEMM fwd+bwd
    pipe = _pipe(compiled, {"vocab_size": vocab}, pp=pp)
    assert pipe.placement == "balanced by the cost model (FLOPs)"
    assert _counts(pipe) == _brute_force(layer, pre, post, 8, pp)
    assert [s.layers for s in pipe.stages] == [tuple(range(sum(_counts(pipe)[:i]), sum(_counts(pipe)[:i + 1])))
                                                for i in range(pp)]
    assert pipe.stages[0].pre_process and pipe.stages[-1].post_process
    assert not any(s.pre_process for s in pipe.stages[1:]) and not any(s.post_process for s in pipe.stages[:-1])


def test_balance_expected_cuts(compiled):
    # vocab 1024: post = 100663296 < one layer (163577856): an even cut is optimal at P = 2 and 4
    assert _counts(_pipe(compiled, pp=2)) == [4, 4]
    assert _counts(_pipe(compiled, pp=4)) == [2, 2, 2, 2]
    # vocab 8192: post = 805306368 = 4.92 L. P=2: (7,1) costs max(7L, 5.92L) = 7L, (6,2) max(6L, 6.92L)
    # = 6.92L, (5,3) 7.92L: (6,2). P=4: the last stage costs >= L + post = 5.92L, so that is the
    # optimum with one layer there; the other 7 fit anywhere (<= 5 per stage), and with the earliest
    # stages taking the fewest: (1,1,5,1)
    assert _counts(_pipe(compiled, {"vocab_size": 8192}, pp=2)) == [6, 2]
    assert _counts(_pipe(compiled, {"vocab_size": 8192}, pp=4)) == [1, 1, 5, 1]


def test_balance_ties_give_early_stages_fewer_layers():
    assert _balance([1] * 7, (0, 0), 2) == [3, 4]
    # optimum 3 per stage: (1,3,3,3), (2,2,3,3), (2,3,2,3), ... tie; the earliest take the fewest
    assert _balance([1] * 10, (0, 0), 4) == [1, 3, 3, 3]
    # the first pays 3: (3,5) max(6, 5) = 6 and (2,6) max(5, 6) = 6 tie, (1,7) = 7: (2,6)
    assert _balance([1] * 8, (3, 0), 2) == [2, 6]
    # the last pays 3: (5,3) max(5, 6) = 6 and (6,2) max(6, 5) = 6 tie: (5,3)
    assert _balance([1] * 8, (0, 3), 2) == [5, 3]


def test_layout_places_layers(compiled):
    pipe = _pipe(compiled, pp=2, pp_layout="Et*3|t*5L")
    assert pipe.placement == "by --pipeline-model-parallel-layout"
    assert [s.layers for s in pipe.stages] == [(0, 1, 2), (3, 4, 5, 6, 7)]
    pipe = _pipe(compiled, pp=4, pp_layout="E t | t*3 | t t t | t L")
    assert [s.layers for s in pipe.stages] == [(0,), (1, 2, 3), (4, 5, 6), (7,)]


@pytest.mark.parametrize("pp, first, last, expected", [
    (4, 3, 1, [3, 2, 2, 1]), (2, None, 3, [5, 3]), (2, 6, None, [6, 2]), (4, 2, None, [2, 2, 2, 2]),
    (3, 1, 3, [1, 4, 3]), (4, None, 5, [1, 1, 1, 5]),
])
def test_first_last_stage_layers(compiled, pp, first, last, expected):
    pipe = _pipe(compiled, pp=pp, pp_first_stage_layers=first, pp_last_stage_layers=last)
    assert _counts(pipe) == expected
    assert [s.layers[0] for s in pipe.stages] == [sum(expected[:i]) for i in range(pp)]


@pytest.mark.parametrize("pp, per", [(2, 2), (2, 1), (4, 1)])
def test_interleaving_assigns_stage_s_to_rank_s_mod_pp(compiled, pp, per):
    pipe = _pipe(compiled, pp=pp, pp_virtual_stage_layers=per)
    v = 8 // (pp * per)
    assert pipe.size == pp and pipe.virtual == v and len(pipe.stages) == pp * v
    assert [(s.index, s.rank, s.chunk) for s in pipe.stages] == [(i, i % pp, i // pp) for i in range(pp * v)]
    assert [s.layers for s in pipe.stages] == [tuple(range(i * per, (i + 1) * per)) for i in range(pp * v)]
    assert [s.pre_process for s in pipe.stages] == [i == 0 for i in range(pp * v)]
    assert [s.post_process for s in pipe.stages] == [i == pp * v - 1 for i in range(pp * v)]
    # every stage but the first receives the residual stream, every one but the last sends it
    assert [bool(s.recv) for s in pipe.stages] == [i > 0 for i in range(pp * v)]
    assert [bool(s.send) for s in pipe.stages] == [i < pp * v - 1 for i in range(pp * v)]
    h, seq = TINY["hidden_size"], TINY["seq_length"]
    # the residual stream at the typing pass's layout: [seq, batch, hidden] (micro-batch 1)
    assert {x.shape for s in pipe.stages for x in s.send} == {(seq, 1, h)}
    assert [x.bytes for s in pipe.stages for x in s.recv] == [seq * h * 2] * (pp * v - 1)  # bf16, the default


def test_interleaving_with_a_layout(compiled):
    pipe = _pipe(compiled, pp=2, pp_virtual_stage_layers=2, pp_layout="Et|t*3|t*3|tL")
    assert [(s.rank, s.chunk, s.layers) for s in pipe.stages] == [
        (0, 0, (0,)), (1, 0, (1, 2, 3)), (0, 1, (4, 5, 6)), (1, 1, (7,))]


_BAD = [
    ({"pp": 0}, "--pipeline-model-parallel-size", "must be at least 1"),
    ({"pp": 16}, "--pipeline-model-parallel-size", "8 layers cannot be cut into 16 pipeline stages"),
    ({"pp": 2, "pp_virtual_stage_layers": 0}, "--num-layers-per-virtual-pipeline-stage", "must be at least 1"),
    ({"pp": 2, "pp_virtual_stage_layers": 3}, "--num-layers-per-virtual-pipeline-stage", "do not divide 8 layers"),
    ({"pp": 1, "pp_virtual_stage_layers": 2}, "--num-layers-per-virtual-pipeline-stage", "has no effect"),
    ({"pp": 1, "pp_layout": "Et*8L"}, "--pipeline-model-parallel-layout", "has no effect"),
    ({"pp": 2, "pp_first_stage_layers": 0}, "--decoder-first-pipeline-num-layers", "must be at least 1"),
    ({"pp": 2, "pp_last_stage_layers": 9}, "--decoder-last-pipeline-num-layers", "places 9 of the 8 layers"),
    ({"pp": 4, "pp_first_stage_layers": 1}, "--decoder-first-pipeline-num-layers", "do not split evenly"),
    ({"pp": 2, "pp_first_stage_layers": 3, "pp_last_stage_layers": 3}, "--decoder-first-pipeline-num-layers",
     "leaving 2 for 0 other"),
    ({"pp": 2, "pp_first_stage_layers": 3, "pp_layout": "Et*3|t*5L"}, "--decoder-first-pipeline-num-layers",
     "conflicts with --pipeline-model-parallel-layout"),
    ({"pp": 2, "pp_last_stage_layers": 2, "pp_virtual_stage_layers": 2}, "--decoder-last-pipeline-num-layers",
     "cannot be combined with --num-layers-per-virtual-pipeline-stage"),
    ({"pp": 2, "pp_layout": "Et*3|x|t*5L"}, "--pipeline-model-parallel-layout", "unexpected 'x' in stage 1"),
    ({"pp": 2, "pp_layout": "Et*3|t*3|t*2L"}, "--pipeline-model-parallel-layout", "gives 3 stage(s), the pipeline has 2"),
    ({"pp": 2, "pp_layout": "Et*3|t*4L"}, "--pipeline-model-parallel-layout", "places 7 layers, the spec has 8"),
    ({"pp": 2, "pp_layout": "t*3|Et*5L"}, "--pipeline-model-parallel-layout", "E (the embedding side)"),
    ({"pp": 2, "pp_layout": "Et*3L|t*5"}, "--pipeline-model-parallel-layout", "L (the output layer and loss)"),
    ({"pp": 3, "pp_layout": "Et*4||t*4L"}, "--pipeline-model-parallel-layout", "stage 1 holds no layer"),
]


@pytest.mark.parametrize("settings, flag, what", _BAD, ids=[str(b[0]) for b in _BAD])
def test_bad_values_are_one_line_naming_the_flag(compiled, settings, flag, what):
    with pytest.raises(SpecError) as info:
        _pipe(compiled, **settings)
    text = info.value.format()
    assert "\n" not in text
    assert text.startswith(flag), text
    assert what in text, text


_NO_REPEAT = """name: tiny
config:
  hidden_size: 64
  vocab_size: 256
model:
  module: Model
  inputs:
    tokens: {shape: [1, 8], dtype: int64}
modules:
  Model:
    inputs: [tokens]
    submodules:
      embedding: {op: embedding, num_embeddings: "${vocab_size}", embedding_dim: "${hidden_size}"}
      block: {module: MLP}
    forward:
      - h = embedding(tokens)
      - h = block(h)
      - return h
  MLP:
    inputs: [x]
    submodules:
      fc1: {op: linear, parallel: column, in_features: "${hidden_size}", out_features: "${4 * hidden_size}"}
      act: {op: gelu}
      fc2: {op: linear, parallel: row, in_features: "${4 * hidden_size}", out_features: "${hidden_size}"}
    forward:
      - h = fc1(x)
      - h = act(h)
      - y = fc2(h)
      - return y
"""


def test_no_repeated_block_is_a_located_error(tmp_path):
    from specc.compiler import load_and_compile
    from specc.frontend.model import Settings

    path = tmp_path / "norepeat.yaml"
    path.write_text(_NO_REPEAT)
    assert load_and_compile(str(path), Settings())[1].pipeline is None  # fine at PP=1
    with pytest.raises(SpecError) as info:
        load_and_compile(str(path), Settings(pp=2))
    err = info.value
    assert err.loc is not None and err.loc.path == str(path) and err.loc.line > 0
    assert "Model" in err.what and "repeated block" in err.what and "has none" in err.what
    text = err.format()
    assert "\n" not in text and text.startswith(f"{path}:{err.loc.line}:")


@pytest.mark.parametrize("p, v, m", [(2, 1, 2), (2, 1, 4), (2, 1, 8), (4, 1, 4), (4, 1, 8), (4, 2, 4),
                                     (4, 2, 8), (2, 2, 4), (8, 1, 1), (1, 1, 4)])
def test_bubble_fraction(p, v, m):
    expected = Fraction(p - 1, v * m + p - 1)
    assert bubble_fraction(p, v, m) == pytest.approx(float(expected), abs=1e-15)


def test_bubble_fraction_values():
    assert bubble_fraction(2, 1, 4) == pytest.approx(1 / 5)
    assert bubble_fraction(4, 1, 8) == pytest.approx(3 / 11)
    assert bubble_fraction(4, 2, 8) == pytest.approx(3 / 19)
    assert bubble_fraction(1, 1, 8) == 0


@pytest.mark.parametrize("pp, per", [(2, None), (4, None), (2, 2), (4, 1), (2, 1)])
def test_plan_bubble(compiled, pp, per):
    _, graph = compiled("gpt.yaml", overrides=TINY, pp=pp, pp_virtual_stage_layers=per)
    totals = build_plan(graph).totals["pipeline"]
    v = 1 if per is None else 8 // (pp * per)
    assert totals["size"] == pp and totals["virtual"] == v
    assert totals["schedule"] == ("1F1B" if v == 1 else "interleaved 1F1B")
    expected = {str(k * pp): round(float(Fraction(pp - 1, v * k * pp + pp - 1)), 6) for k in (1, 2, 4, 8)}
    assert totals["bubble"] == expected


@pytest.mark.parametrize("pp", [2, 3, 4, 8])
@pytest.mark.parametrize("m", [1, 2, 3, 4, 8, 16])
def test_1f1b_in_flight(compiled, pp, m):
    pipe = _pipe(compiled, pp=pp)
    assert [in_flight(s, pp, 1, m) for s in pipe.stages] == [min(pp - i, m) for i in range(pp)]


@pytest.mark.parametrize("pp", [2, 4])
def test_plan_in_flight_per_rank(compiled, pp):
    _, graph = compiled("gpt.yaml", overrides=TINY, pp=pp)
    totals = build_plan(graph).totals["pipeline"]
    m = 8 * pp  # the plan's peak is taken at m = 8P
    assert [s["in_flight"] for s in totals["stages"]] == [min(pp - i, m) for i in range(pp)]
    assert [r["in_flight"] for r in totals["ranks"]] == [pp - i for i in range(pp)]
    for r, st in zip(totals["ranks"], totals["stages"]):
        assert r["peak_activation_bytes"] == st["activation_bytes"] * (pp - r["rank"])
    assert [s["layers"] for s in totals["stages"]] == [list(s.layers) for s in graph.pipeline.stages]
