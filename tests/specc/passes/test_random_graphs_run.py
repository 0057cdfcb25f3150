"""Property test: random valid op graphs compile AND run. Each drawn graph is built at TP 2 and 4
(with and without sequence parallelism) and at CP 2, on 4 gloo ranks, from randomized non-trivial
weights (biases away from 0, gains away from 1), and must match the same graph at TP=1 in the
per-token loss, every gradient and the weights after one SGD step. The graphs mix the blocks of
test_random_graphs.py with what broke before: embeddings feeding linears directly, norms over
gathered (fused) values, `parallel: none` linears, and several model inputs.

Tolerances: fp32 (u = 6e-8). Parallelism changes only the order of summation — dot products of
length <= 96, partial sums of up to 4 ranks, the ring's log-sum-exp merges — a few ops deep, so a
value differs from TP=1 by well under 1e-5 of the largest value of its tensor; a gradient that is
zero in exact arithmetic is rounding noise of the largest gradient of its tensor."""

from __future__ import annotations

import os
import re
import sys

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

torch = pytest.importorskip("torch")

HERE = os.path.dirname(os.path.abspath(__file__))
if HERE not in sys.path:  # here and in the spawned ranks
    sys.path.insert(0, HERE)

import random_graph_ranks  # noqa: E402
from test_random_graphs import BLOCKS, H, S, V, block, submodules  # noqa: E402

import specc_torch  # noqa: E402
from specc.errors import SpecError  # noqa: E402
from specc.settings import Settings  # noqa: E402

B, WORLD, REL = 2, 4, 1e-5
EXTRA = f"""
      emb2: {{op: embedding, num_embeddings: {V}, embedding_dim: {H}}}
      qkv_norm: {{op: layernorm, hidden_size: {3 * H}}}"""


def extra_block(kind: str, x: str, n: int) -> tuple:
    if kind == "emb_linear":  # an embedding read only by a column-parallel GEMM
        return [f"e{n} = up(emb2(tokens))", f"v{n} = {x} + down_b(act(e{n}))"], f"v{n}"
    # a norm over the gathered full q/k/v width, then attention
    return [f"q{n}, k{n}, w{n} = split3(qkv_norm(qkv(norm({x}))))", f"v{n} = {x} + proj(attn(q{n}, k{n}, w{n}))"], f"v{n}"


@st.composite
def random_program(draw):
    """(spec text, model input names)."""
    names = ["tokens", "segment"] if draw(st.booleans()) else ["tokens"]
    first = "h = emb(tokens) + emb2(segment)" if len(names) == 2 else "h = emb(tokens)"
    steps, x, earlier = [first], "h", ["h"]
    kinds = BLOCKS + ("emb_linear", "fused_norm")
    for n in range(draw(st.integers(1, 4))):
        kind = draw(st.sampled_from(kinds))
        new, x = extra_block(kind, x, n) if kind in ("emb_linear", "fused_norm") else block(kind, x, n, earlier, draw)
        steps += new
        earlier.append(x)
    steps += [f"logits = head({draw(st.sampled_from(['norm', 'rms']))}({x}))", "l = loss(logits, labels)", "return l"]
    forward = "\n".join(f"      - {s}" for s in steps)
    used = "\n".join(line for line in (submodules() + EXTRA).splitlines()
                     if line.strip() and re.search(rf"\b{line.split(':')[0].strip()}\(", forward))
    inputs = "".join(f"    {n}: {{shape: [{B}, {S}], dtype: int64}}\n" for n in names + ["labels"])
    text = (f"name: random_run\nmodel:\n  module: M\n  inputs:\n{inputs}modules:\n  M:\n"
            f"    inputs: [{', '.join(names + ['labels'])}]\n    submodules:\n{used}\n    forward:\n{forward}\n")
    return text.replace("{op: dropout, p: 0.1}", "{op: dropout, p: 0.0}"), names + ["labels"]


def _close(got, ref, scale=None) -> bool:
    scale = ref.abs().max().item() if scale is None else scale
    return (got - ref).abs().max().item() <= REL * max(scale, 1e-30) + 1e-7


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                 HealthCheck.function_scoped_fixture])
@given(program=random_program(), setting=st.sampled_from([(2, 1, False), (2, 1, True), (4, 1, False),
                                                          (4, 1, True), (1, 2, False), (2, 2, True)]))
def test_random_graphs_run_and_match_tp1(gloo, tmp_path_factory, program, setting):
    text, names = program
    tp, cp, sp = setting
    path = str(tmp_path_factory.mktemp("run") / "random.yaml")
    with open(path, "w") as f:
        f.write(text)
    try:  # compile it correctly or refuse it with one located line: never a module that cannot run
        specc_torch.compile_source(path, Settings(tp=tp, sp=sp, cp=cp, dtype="fp32"))
    except SpecError as e:
        assert e.loc is not None and "\n" not in e.format()
        return
    ref = random_graph_ranks.step(0, 1, path, 1, 1, False, V, B, S, names)
    got = gloo.run(WORLD, random_graph_ranks.step, path, tp, cp, sp, V, B, S, names)[0]
    assert _close(got["loss"], ref["loss"]), (text, setting, "loss")
    for what in ("grads", "weights"):
        for name, r in ref[what].items():
            assert got[what][name].shape == r.shape, (name, setting)
            assert _close(got[what][name], r), (text, setting, what, name,
                                                (got[what][name] - r).abs().max().item(), r.abs().max().item())
