"""The time model's pipeline sends under the runtime's scatter/gather over TP (runtime/pipeline.py):
at TP > 1 without SP a stage sends each TP rank's 1/t slice of the boundary activation over the
pipeline link and the receiver all-gathers it over the TP link (the gradient likewise back); with
SP the boundary value is sequence-sharded already, 1/t a rank, and travels whole."""

from __future__ import annotations

import copy
import dataclasses
import os

import pytest

from specc.compiler import load_and_compile
from specc.errors import Loc
from specc.frontend.model import Settings
from specc.plan import build_plan
from specc.plan.machine import load_machine
from specc.plan.time import BUCKET_ELEMENTS, Job, _tied_elements, collective_time, group_link, predict

GPT_TINY = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "..", "specs", "gpt-tiny.yaml")
A100 = load_machine("dgx-a100-80gb")
EFF = A100.link_efficiency
# activations of 2 MiB, so that bandwidth, not latency, sets the sends' time
SIZES = (("num_layers", 4), ("hidden_size", 1024), ("num_attention_heads", 8), ("seq_length", 1024))


def _plan(**settings):
    spec, graph = load_and_compile(GPT_TINY, Settings(pp=2, **settings), [(k, v, Loc("--set")) for k, v in SIZES],
                                   plan_only=True)
    return build_plan(graph), spec.inputs[0].shape[1]


def _free(machine):
    return dataclasses.replace(machine, peak_flops={k: 1e40 for k in machine.peak_flops}, memory_bandwidth=1e40,
                               gemm_half_flops=0.0)


def test_sends_are_scattered_over_tp_without_sp_and_sharded_with_it():
    plain, seq = _plan(tp=1)
    whole = plain.totals["pipeline"]["stages"][0]["send_bytes"]  # s b h x 2 bytes at TP 1
    nosp, _ = _plan(tp=2)
    sp, _ = _plan(tp=2, sp=True)
    first, last = nosp.totals["pipeline"]["stages"]
    assert first["send_bytes"] == first["send_scattered_bytes"] == whole  # replicated: whole, cut on the wire
    assert last["recv_bytes"] == last["recv_scattered_bytes"] == whole
    for st in sp.totals["pipeline"]["stages"]:  # SP: already 1/t a rank, nothing more to cut
        assert st["send_scattered_bytes"] == st["recv_scattered_bytes"] == 0
    assert sp.totals["pipeline"]["stages"][0]["send_bytes"] == whole // 2
    assert plain.totals["pipeline"]["stages"][0]["send_scattered_bytes"] == 0  # TP 1


@pytest.mark.parametrize("gpus", [4, 16])  # the pipeline inside a node (NVLink), and across nodes (one NIC a GPU)
def test_scattered_send_is_a_slice_over_pp_and_an_all_gather_over_tp(gpus):
    plan, seq = _plan(tp=2)
    machine = _free(A100)
    m = 4
    job = Job(gpus, m * gpus // 4)  # DP = gpus / 4, m micro-batches each
    b = plan.totals["pipeline"]["stages"][0]["send_bytes"]
    dp = gpus // 4
    pp_link = group_link(machine, 2 * dp, 2)[0]
    tp_link = group_link(machine, 1, 2)[0]
    got = predict(plan, seq, machine, job)["breakdown_s"]
    # each rank sends one slice a micro-batch (rank 0 the activation, rank 1 its gradient) and
    # gathers one (rank 1 the activation, rank 0 the gradient)
    assert got["pp_comm"] == pytest.approx(m * collective_time("send", b / 2, 2, pp_link, EFF), rel=1e-12)
    unscattered = copy.deepcopy(plan)
    for st in unscattered.totals["pipeline"]["stages"]:
        st["send_scattered_bytes"] = st["recv_scattered_bytes"] = 0
    before = predict(unscattered, seq, machine, job)["breakdown_s"]
    assert before["pp_comm"] == pytest.approx(m * collective_time("send", b, 2, pp_link, EFF), rel=1e-12)
    gather = collective_time("all_gather", b, 2, tp_link, EFF)
    assert got["tp_comm"] - before["tp_comm"] == pytest.approx(m * gather, rel=1e-9)
    # across nodes the slice over one NIC beats the whole over it, even with the NVLink gather
    assert (got["pp_comm"] + got["tp_comm"] < before["pp_comm"] + before["tp_comm"]) == (gpus == 16)


def _slow(machine):
    return dataclasses.replace(machine, peak_flops={k: 1e6 for k in machine.peak_flops}, memory_bandwidth=1e6)


def test_data_parallel_reduction_overlaps_backward_and_the_pipelines_drain():
    """The runtime starts the DP buckets during the last micro-batch's backward: at PP 1, and at
    PP > 1 in each stage's last backward (runtime/ddp.py final_backward), except the bucket of
    the weight tied across the pipeline's ends, which waits for the tied sum after the schedule.
    With free compute nothing hides them; with slow compute all but one bucket hide behind the
    backward, and at PP 2 the tied weight's bucket stays exposed."""
    piped, seq = _plan(tp=1)
    spec, graph = load_and_compile(GPT_TINY, Settings(), [(k, v, Loc("--set")) for k, v in SIZES], plan_only=True)
    flat = build_plan(graph)
    dp_link = group_link(A100, 1, 2)[0]
    held = collective_time("all_reduce", _tied_elements(piped, piped.totals["pipeline"]) * 4, 2, dp_link, EFF)
    bucket = collective_time("all_reduce", BUCKET_ELEMENTS * 4, 2, dp_link, EFF)
    assert held > 0
    for plan, gpus in ((piped, 4), (flat, 2)):
        for machine in (A100, _free(A100), _slow(A100)):
            on, off = (predict(plan, seq, machine, Job(gpus, 4, overlap_grad_reduce=x))["breakdown_s"]["dp_grad_reduce"]
                       for x in (True, False))
            assert off > 0
            if machine is not A100 and machine.peak_flops["bf16"] > 1e30:  # nothing to hide behind
                # (the held bucket and each chunk's are collectives of their own: a latency each)
                assert off * (1 - 1e-12) <= on <= off + 2 * 2 * dp_link.latency  # a ring all-reduce of 2: 2 steps
            elif machine is not A100:  # everything but the last bucket (and the tied one) hidden
                assert on < off and on <= (held if plan is piped else 0.0) + bucket * (1 + 1e-9)
                if plan is piped:
                    assert on >= held * (1 - 1e-12)
            else:
                assert on < off
