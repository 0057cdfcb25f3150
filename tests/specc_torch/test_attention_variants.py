"""`specc verify` of the attention and position variants in one decoder
(tests/specc_torch/specs/attention-variants-tiny.yaml: grouped-query attention, a sliding window on
alternate layers, a custom scale, soft-capped scores, document ids reaching every layer,
interleaved partial rotary with llama3 scaling, logits returned beside the loss) at TP 1, 2 and 4
with and without SP; and every mask under context parallelism (with mistral-tiny and bert-tiny)."""

from __future__ import annotations

import os

from specc.settings import Settings
from specc_torch import api

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
SPEC = "tests/specc_torch/specs/attention-variants-tiny.yaml"


def test_every_variant_verifies_at_tp_1_2_4_and_returns_the_logits():
    from verify_cli import run_verify

    result = run_verify(SPEC, "--tp", "1,2,4", "--sp", "both")
    assert result.returncode == 0, result.stdout + result.stderr
    for setting in ("tp=2 sp=off", "tp=2 sp=on", "tp=4 sp=off", "tp=4 sp=on"):
        rows = [ln for ln in result.stdout.splitlines() if ln.startswith(setting)]
        assert sum("returned value 1" in ln for ln in rows) == 2, result.stdout  # initial and random weights
        assert all(" FAIL" not in ln for ln in rows), result.stdout


def test_the_layers_get_their_own_windows():
    source, _, graph = api.compile_source(os.path.join(ROOT, SPEC), Settings(tp=2, sp=True))
    windows = [op.attrs.get("window") for op in graph.iter_ops() if op.kind == "core_attention"]
    assert windows == [5, None, 5, None]
    assert source.count("window=5") == 1  # the two layer classes, each emitted once


def _verify(rank, world, cases):
    from specc_torch.verify import VerifyConfig, _verify_all

    out = []
    for spec, tps, cps, comms in cases:
        cfg = VerifyConfig(spec=os.path.join(ROOT, spec), tps=tps, sps=[True], cps=cps, cp_comm_types=comms, steps=1)
        out += [(spec, row) for row in _verify_all(rank, cfg)]
    return out


def test_masks_verify_under_context_parallelism(gloo):
    """Windows, soft-capped scores and document ids at CP > 1 are CP=1's function: loss, logits,
    activations, every gradient and the weights after a step, from the initial and randomized
    weights, and the collectives the plan counts, on one world of 4 ranks. mistral-tiny: a
    window of 5 on 32 tokens, at CP 2 shorter than a chunk, at CP 4 longer (the ring skips
    chunk pairs); bert-tiny: bidirectional within packed documents of unequal lengths (verify
    draws document ids so), TP 2 x CP 2; gemma2-tiny: windowed and full layers alternating
    (window_pattern), soft-capped scores, a custom scale, GQA, at TP 2 x CP 2 (the full layers
    all-gather, the windowed ones ring); the variants add document ids to those, at CP 4. Both
    comm types of every mask, at CP 2 and 4, against a dense reference:
    tests/runtime/test_context_parallel.py."""
    cases = [("specs/mistral-tiny.yaml", [1], [2, 4], ["p2p"]), ("specs/bert-tiny.yaml", [2], [2], ["all_gather"]),
             ("specs/bert-tiny.yaml", [1], [2], ["p2p"]), ("specs/gemma2-tiny.yaml", [2], [2], ["auto"]),
             (SPEC, [1], [4], ["auto"])]
    rows = gloo.run(4, _verify, cases)[0]
    bad = [r for _, r in rows if not r.ok]
    assert not bad, bad
    settings = sorted({(spec, r.setting) for spec, r in rows})
    assert settings == sorted([("specs/mistral-tiny.yaml", "tp=1 cp=2 p2p sp=off"),
                               ("specs/mistral-tiny.yaml", "tp=1 cp=4 p2p sp=off"),
                               ("specs/bert-tiny.yaml", "tp=2 cp=2 all_gather sp=on"),
                               ("specs/bert-tiny.yaml", "tp=1 cp=2 p2p sp=off"),
                               ("specs/gemma2-tiny.yaml", "tp=2 cp=2 sp=on"), (SPEC, "tp=1 cp=4 sp=off")]), settings
    for spec, setting in settings:  # loss, logits, activations, gradients, weights (and the variants' logits
        # returned), collectives; the first five again from randomized weights
        quantities = [r.quantity for s, r in rows if (s, r.setting) == (spec, setting)]
        assert len(quantities) == (13 if spec == SPEC else 11), (setting, quantities)
        assert "random weights: gradients (all params)" in quantities
    # windowed layers ring, full ones all-gather (their gradients reduce-scattered)
    counted = [r.detail for spec, r in rows if r.quantity == "collectives == plan"
               and spec in (SPEC, "specs/gemma2-tiny.yaml")]
    assert len(counted) == 2 and all("send" in d and "reduce_scatter" in d for d in counted), counted
