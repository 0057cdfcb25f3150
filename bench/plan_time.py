"""How long `specc plan` takes for gpt.yaml at 12, 48 and 96 layers (target: 96 layers under one
second, growing linearly). Measures the whole pipeline in process (load, graph, passes, plan,
render), best of several runs, and the command end to end (interpreter start included).

    python bench/plan_time.py
"""

from __future__ import annotations

import os
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from specc.errors import Loc  # noqa: E402
from specc.frontend.model import Settings  # noqa: E402
from specc.pipeline import load_and_compile  # noqa: E402
from specc.plan import build_plan, plan_text  # noqa: E402

SPEC = os.path.join(ROOT, "specs", "gpt.yaml")


def in_process(layers: int, repeats: int = 5) -> float:
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        _, graph = load_and_compile(SPEC, Settings(tp=2, sp=True), [("num_layers", layers, Loc("--set"))])
        plan_text(build_plan(graph))
        best = min(best, time.perf_counter() - start)
    return best


def end_to_end(layers: int) -> float:
    start = time.perf_counter()
    subprocess.run([sys.executable, "-m", "specc", "plan", SPEC, "--tp", "2", "--sp", "--set", f"num_layers={layers}"],
                   cwd=ROOT, check=True, capture_output=True)
    return time.perf_counter() - start


def main() -> None:
    rows = []
    for layers in (12, 48, 96):
        rows.append((layers, in_process(layers), end_to_end(layers)))
    base = rows[0][1] / rows[0][0]
    print(f"{'layers':>6}  {'plan (in process)':>18}  {'per layer':>10}  {'vs 12-layer rate':>16}  {'specc plan (cli)':>16}")
    for layers, t, cli in rows:
        print(f"{layers:>6}  {t * 1000:>15.1f} ms  {t / layers * 1000:>7.2f} ms  {t / layers / base:>15.2f}x  "
              f"{cli * 1000:>13.0f} ms")
    verdict = "meets" if rows[-1][2] < 1.0 else "MISSES"
    print(f"96 layers end to end: {rows[-1][2]:.2f} s ({verdict} the 1 s target)")


if __name__ == "__main__":
    main()
