"""`specc verify` of the attention and position variants in one decoder
(tests/specc_torch/specs/attention-variants-tiny.yaml: grouped-query attention, a sliding window on
alternate layers, a custom scale, soft-capped scores, document ids reaching every layer,
interleaved partial rotary with llama3 scaling, logits returned beside the loss) at TP 1, 2 and 4
with and without SP; and what context parallelism refuses, located."""

from __future__ import annotations

import os

import pytest

from specc.errors import SpecError
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
    source, _, graph = api.compile_source(os.path.join(ROOT, SPEC), 2, True)
    windows = [op.attrs.get("window") for op in graph.iter_ops() if op.kind == "core_attention"]
    assert windows == [5, None, 5, None]
    assert source.count("window=5") == 1  # the two layer classes, each emitted once


@pytest.mark.parametrize("spec, message", [
    (SPEC, "window_pattern is not supported with context parallelism (cp=2)"),
    ("specs/bert-tiny.yaml", "document ids are not supported with context parallelism (cp=2)"),
])
def test_context_parallelism_refuses_what_its_attention_does_not_mask(spec, message):
    with pytest.raises(SpecError) as e:
        api.compile_source(os.path.join(ROOT, spec), 1, cp=2)
    assert message in str(e.value) and e.value.loc.line
