"""The 1F1B makespan the time model charges (specc/plan/time.py one_f_one_b_time) against an
event simulation of torch's Schedule1F1B order (stage k: P - k warmup forwards, then a backward
and a forward in turn, then the remaining backwards; a forward waits for the stage before's, a
backward for the stage after's): exact with equal stages ((m + P - 1) micro-batch times, the
bubble formula's), and within 6% with stages of unequal cost, where the slowest stage's own fill
and drain set the bubble, not the mean's."""

from __future__ import annotations

import random

import pytest

from specc.plan.time import bubble_time, one_f_one_b_time


def simulated(forward: list, backward: list, m: int) -> float:
    p = len(forward)
    order = []
    for k in range(p):
        warmup = min(m, p - k)
        ops, nf = [("F", i) for i in range(warmup)], warmup
        for nb in range(m):
            ops.append(("B", nb))
            if nf < m:
                ops.append(("F", nf))
                nf += 1
        order.append(ops)
    done, clock, at = {}, [0.0] * p, [0] * p
    moved = True
    while moved:
        moved = False
        for k in range(p):
            while at[k] < len(order[k]):
                kind, i = order[k][at[k]]
                if kind == "F":
                    dep = ("F", k - 1, i) if k > 0 else None
                else:
                    dep = ("B", k + 1, i) if k < p - 1 else ("F", k, i)
                if dep is not None and dep not in done:
                    break
                clock[k] = max(clock[k], done.get(dep, 0.0)) + (forward[k] if kind == "F" else backward[k])
                done[(kind, k, i)] = clock[k]
                at[k] += 1
                moved = True
    assert at == [len(ops) for ops in order]  # no deadlock: every op ran
    return max(clock)


@pytest.mark.parametrize("p,m", [(2, 4), (4, 8), (8, 8), (8, 64)])
def test_equal_stages_are_the_bubble_formula(p, m):
    t_f, t_b = 1.0, 2.0
    got = one_f_one_b_time([t_f] * p, [t_b] * p, m)
    assert got == pytest.approx(m * (t_f + t_b) + bubble_time(p, 1, t_f + t_b), rel=1e-12)
    assert got == pytest.approx(simulated([t_f] * p, [t_b] * p, m), rel=1e-12)


def test_unequal_stages_follow_the_simulated_schedule():
    rng = random.Random(0)
    worst = 0.0
    for _ in range(200):
        p = rng.choice([2, 3, 4, 8])
        m = rng.choice([p, 2 * p, 4 * p, 3 * p + 1])
        forward = [rng.uniform(0.5, 2.0) for _ in range(p)]
        backward = [2 * f * rng.uniform(0.8, 1.2) for f in forward]
        sim = simulated(forward, backward, m)
        got = one_f_one_b_time(forward, backward, m)
        worst = max(worst, abs(got - sim) / sim)
        # each stage's path is one the schedule must run: never above the schedule's makespan
        assert got <= sim * (1 + 1e-12)
    assert worst <= 0.06, worst


def test_a_slow_first_stage_hides_most_of_the_bubble():
    # the calibrated host's PP 2 split (embedding and 3 layers, then 1 layer and the loss), in ms
    forward, backward, m = [21.7, 13.9], [42.0, 27.3], 4
    got = one_f_one_b_time(forward, backward, m)
    mean = (sum(forward) + sum(backward)) / 2
    assert got == pytest.approx(4 * 63.7 + (41.2 - 21.7), rel=1e-12)  # the wait for the first gradient
    assert got < m * 63.7 + bubble_time(2, 1, mean)  # the mean-based bubble charged 52.5 ms
    assert got == pytest.approx(simulated(forward, backward, m), rel=0.01)
