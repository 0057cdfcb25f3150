"""`specc calibrate`'s profile (specc_cli/calibrate.py) from measurements that follow the time
model's closed forms exactly: the profile `--machine` reads gives back their constants."""

from __future__ import annotations

import pytest

from specc.ops.attention import cp_block_flops, cp_block_pass_bytes
from specc.plan.machine import load_machine
from specc.plan.time import collective_time, gemm_time, memory_time
from specc_cli.calibrate import (
    ALL_REDUCE_BYTES,
    ALL_TO_ALL_BYTES,
    DTYPES,
    ELEMENTWISE,
    GEMM_SIZES,
    GEMM_VARIANTS,
    LAYER_SHAPES,
    OP_CHAINS,
    SEND_BYTES,
    profile_yaml,
)


def _cp_block_seconds(scores, head_dim, batched_rate, half, passes_rate, per_call):
    """CP's blocks as the time model charges them: forward GEMM, backward as two, the passes over
    the scores, and one op call each way."""
    f_fwd, f_bwd = cp_block_flops(scores, head_dim, head_dim)
    fwd, bwd = cp_block_pass_bytes(False, False)
    return ((f_fwd + half) / batched_rate + 2 * (f_bwd / 2 + half) / batched_rate
            + (fwd + bwd) * scores / passes_rate + 2 * per_call)


def test_profile_recovers_the_constants(tmp_path):
    rate = {"fp32": 40e9, "bf16": 5e9, "fp16": 4e9}
    half, bandwidth, latency, link, ranks = 3e6, 12e9, 2e-4, 3e9, 4
    p2p_latency, p2p_link, per_call = 5e-4, 1e9, 4e-5
    measured = {
        "gemm": {d: [(f, (f + half) / rate[d], v) for n in GEMM_SIZES[d] for m_, k, n_ in LAYER_SHAPES
                     for f in [2.0 * m_ * k * n_ * n ** 3] for v in GEMM_VARIANTS] for d in DTYPES},
        # fused attention at 0.4 of the fp32 GEMM rate: forward (F + F_half), backward twice that
        "attention": [(f, 3 * (f + half) / (0.4 * rate["fp32"])) for f in (1e8, 4e8, 9e8)],
        # batched per-head products at 0.3 of it, the same form
        "batched": [(f, 3 * (f + half) / (0.3 * rate["fp32"])) for f in (2e7, 1e8, 3e8)],
        # CP's blocks: their GEMMs at the batched rate, the op's overhead each way, and their passes
        # over the scores at 0.25 of the memory-bound rate (one noisy point, the median ignores it)
        "cp_blocks": [(s, d, causal, _cp_block_seconds(s, d, 0.3 * rate["fp32"], half, 0.25 * bandwidth, per_call)
                       * (1.5 if (s, causal) == (1 << 20, True) else 1.0))
                      for s, d in ((1 << 18, 32), (1 << 19, 64), (1 << 20, 64)) for causal in (True, False)],
        # (GEMM alone, collective alone, together): 0.6 of the shorter saved, one contended (-0.5)
        "overlap": [(2e-3, 1e-3, 2.4e-3), (4e-3, 5e-3, 6.4e-3), (1e-3, 1e-3, 1.4e-3), (2e-3, 1e-3, 3.5e-3)],
        # the fused optimizer step streams its 32 bytes an element at 2.5x the kernel mix's rate
        "optimizer": [(n, n * 32 / (2.5 * bandwidth)) for n in (1 << 20, 1 << 22)],
        "memory": [(k * n, k * n / bandwidth) for n in ELEMENTWISE for k in (12, 8, 9, 8, 8)],
        "collectives": [(b, 2 * (ranks - 1) * latency + 2 * (ranks - 1) / ranks * b / link) for b in ALL_REDUCE_BYTES],
        "sends": [(b, p2p_latency + b / p2p_link) for b in SEND_BYTES],
        "all_to_all": [(b, (ranks - 1) * p2p_latency + (ranks - 1) / ranks * b / p2p_link) for b in ALL_TO_ALL_BYTES],
        "overhead": [(k, 1e-3 + k * 2 * per_call) for k in OP_CHAINS],  # forward and backward of k calls
        "rss": 4e8, "threads": 1, "transport": "collectives on CPU tensors: through torch.distributed",
    }
    path = tmp_path / "cpu.yaml"
    path.write_text(profile_yaml(measured, ranks, "cpu"))
    m = load_machine(str(path))
    assert m.devices_per_node == ranks and m.gemm_efficiency == m.memory_efficiency == m.link_efficiency == 1.0
    for d in DTYPES:
        assert m.peak(d) == pytest.approx(rate[d], rel=1e-3)
    assert m.gemm_half_flops == pytest.approx(half, rel=1e-3)
    assert m.attention_efficiency == pytest.approx(0.4, rel=1e-3)
    assert m.batched_gemm_efficiency == pytest.approx(0.3, rel=1e-3)
    assert m.cp_blocks_efficiency == pytest.approx(0.25, rel=1e-3)
    assert m.comm_overlap == pytest.approx(0.6, rel=1e-3)
    assert m.optimizer_efficiency == pytest.approx(2.5, rel=1e-3)
    assert m.memory_bandwidth == pytest.approx(bandwidth, rel=1e-3)
    assert m.intra_node.latency == pytest.approx(latency, rel=1e-3) and m.intra_node.bandwidth == pytest.approx(link, rel=1e-3)
    assert m.point_to_point.latency == pytest.approx(p2p_latency, rel=1e-3)
    assert m.point_to_point.bandwidth == pytest.approx(p2p_link, rel=1e-3)
    assert m.op_overhead == pytest.approx(per_call, rel=1e-3)
    assert m.all_to_all.latency == pytest.approx(p2p_latency, rel=1e-3)
    assert m.all_to_all.bandwidth == pytest.approx(p2p_link, rel=1e-3)
    # and the time model reads them back as measured
    f = 2.0 * 256 ** 3
    assert gemm_time(f, m, "fp32") == pytest.approx((f + half) / rate["fp32"], rel=1e-3)
    assert gemm_time(f, m, "fp32", "batched_gemm") == pytest.approx((f + half) / (0.3 * rate["fp32"]), rel=1e-3)
    assert gemm_time(f, m, "fp32", "cp_blocks") == gemm_time(f, m, "fp32", "batched_gemm")
    assert memory_time(1e6, m, "cp_blocks") == pytest.approx(1e6 / (0.25 * bandwidth), rel=1e-3)
    assert memory_time(1e6, m) == pytest.approx(1e6 / bandwidth, rel=1e-3)
    assert collective_time("all_reduce", 1 << 20, ranks, m.intra_node, 1.0) == pytest.approx(
        measured["collectives"][2][1], rel=1e-3)


def test_a_flat_measurement_gives_a_positive_link():
    """Times that do not grow with the bytes (noise on a loaded host) still give a usable link: the
    largest point's rate and the smallest point's time as latency, never a negative bandwidth."""
    from specc_cli.calibrate import _link

    latency, bandwidth = _link([(4096, 2.4e-3), (1 << 20, 2.0e-3), (1 << 22, 1.5e-3)], 1, 1.0)
    assert latency == pytest.approx(2.4e-3) and bandwidth == pytest.approx((1 << 22) / 1.5e-3)
