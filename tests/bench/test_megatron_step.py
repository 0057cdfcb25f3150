"""bench/megatron_step.py's report arithmetic (its tables are bench/megatron_step_report.py's),
without Megatron Core (a bench-only install): the ratio is the median of per-round ratios, the
targets, MFU, the collectives' hidden fraction."""

from __future__ import annotations

import types

from bench_modules import load

megatron_step = load("megatron_step")
report = load("megatron_step_report")


def _result(rounds, comm=None):
    return {"rounds": rounds, "first_loss": {n: 8.25 for n in rounds[0]}, "peaks": [100.0] * len(rounds), "comm": comm,
            "transport": "shared memory"}


def test_the_ratio_is_the_median_of_per_round_ratios_and_the_targets_follow_tp():
    cfg = types.SimpleNamespace(torch_compile=False)
    rounds = [{"specc": 0.8, "megatron": 1.0, "specc-own": 0.5, "megatron-own": 1.0},
              {"specc": 0.9, "megatron": 1.0, "specc-own": 0.9, "megatron-own": 1.0},
              {"specc": 2.0, "megatron": 1.0, "specc-own": 0.8, "megatron-own": 1.0}]  # one round under load
    results = {"tp1": _result(rounds), "tp2": _result(rounds)}
    text = report.table(cfg, results, flops=50e9)
    rows = text.splitlines()[2:]
    assert "**0.900**" in rows[0] and "< 1 met" in rows[0]  # median(0.8, 0.9, 2.0)
    assert "**0.900**" in rows[1] and "<= 0.85 missed" in rows[1]
    # MFU: 50 GFLOP over the median step (0.9 s) over 100 GFLOP/s per rank, times the ranks
    assert "55.6%" in rows[0] and "27.8%" in rows[1]
    own = report.table(cfg, results, 50e9, "specc-own", "megatron-own").splitlines()[2:]
    assert "**0.800**" in own[1] and "<= 0.85 met" in own[1]


def test_the_collectives_table_says_how_much_of_their_time_the_step_hides():
    results = {"tp1": _result([{"specc": 1.0, "megatron": 1.0}]),
               "tp2": _result([{"specc": 1.0, "megatron": 1.0}],
                              {"specc": {"count": 20, "bytes": 18 * 2 ** 20, "alone": 0.080, "exposed": 0.020},
                               "specc-gloo": {"count": 20, "bytes": 18 * 2 ** 20, "alone": 0.160, "exposed": 0.120}}),
               "tp2sp": _result([{"specc": 1.0, "megatron": 1.0}],
                                {"specc": {"count": 49, "bytes": 46 * 2 ** 20, "alone": 0.100, "exposed": 0.110}})}
    rows = report.comm_table(results).splitlines()[2:]
    assert len(rows) == 3  # TP=1 issues none
    assert rows[0] == "| TP=2 (2 ranks) | shared memory | 20 | 18.0 | 80.0 | 20.0 | 75% |"
    assert rows[1] == "| TP=2 (2 ranks) | gloo | 20 | 18.0 | 160.0 | 120.0 | 25% |"
    assert rows[2].endswith("| -10% |")  # waiting absorbed the other rank being late
    assert report.comm_table({"tp1": results["tp1"]}) == ""


def test_specc_on_gloo_is_a_column_of_the_model_step_at_tp_above_one():
    cfg = types.SimpleNamespace(torch_compile=False)
    tp1 = [{"specc": 0.9, "megatron": 1.0}] * 3
    tp2 = [{"specc": 0.7, "megatron": 1.0, "specc-gloo": g} for g in (0.95, 1.1, 0.9)]
    text = report.table(cfg, {"tp1": _result(tp1), "tp2": _result(tp2)}, flops=50e9)
    head, _, row1, row2 = text.splitlines()
    assert head.endswith(" specc on gloo (ms) | on gloo / Megatron |")
    assert row1.endswith("| — | — |")  # one rank: no collectives, no transport
    assert row2.endswith("| 950.0 | 0.950 |")  # the median step and the median per-round ratio
    assert report.transports({"tp1": _result(tp1), "tp2": _result(tp2)}) == "shared memory"


def test_the_tp1_line_says_what_bounds_mfu():
    res = _result([{"specc": 1.0, "megatron": 1.0}])
    # the peak read between the profiled steps, not the rounds' (120)
    res["matmul"] = {"step": 0.8, "gemm": 0.5, "attention": 0.1, "optimizer": 0.04, "peak_gflops": 100.0}
    res["peaks"] = [120.0]
    # 45 GFLOP of GEMMs in 0.5 s: 90% of the peak; 3 GFLOP of attention in 0.1 s: 30%
    line = megatron_step.matmul_line(res, flops=48e9, attention_flops=3e9)
    assert "read between the profiled steps, 100.0 GFLOP/s" in line
    assert "matrix multiplies take 62% of the step and run at 90% of the peak" in line
    assert "attention's fused kernels take 12% and run at 30% of it" in line
    # MFU = 0.625 x 0.9 + 0.125 x 0.3 = 60%: exactly 48 GFLOP in 0.8 s over 100 GFLOP/s
    assert "so MFU is 60%" in line
    assert "the optimizer 5%, everything else (norms, GELU, residual adds, the loss, the embedding) 20%" in line


def test_mfu_is_taken_per_round_against_that_rounds_peak():
    cfg = types.SimpleNamespace(torch_compile=False)
    # the machine ran 20% slower in the second round: its steps and its peak moved together
    res = _result([{"specc": 0.5, "megatron": 1.0}, {"specc": 0.6, "megatron": 1.2}, {"specc": 0.5, "megatron": 1.0}])
    res["peaks"] = [100.0, 80.0, 100.0]
    row = report.table(cfg, {"tp1": res}, flops=40e9).splitlines()[2]
    assert "| 80.0% | 40.0% |" in row  # 40 GFLOP in 0.5 s of 100, and in 0.6 s of 80 (83%): median 80%


def test_the_background_load_spins_for_the_run_and_is_gone_after_it():
    with megatron_step.background_load(2) as spinners:
        assert len(spinners) == 2 and all(proc.poll() is None for proc in spinners)
    assert all(proc.poll() is not None for proc in spinners)
    try:
        with megatron_step.background_load(1) as spinners:
            raise KeyboardInterrupt  # an interrupted run leaves no spinner behind
    except KeyboardInterrupt:
        pass
    assert spinners[0].poll() is not None
