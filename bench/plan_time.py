"""How long `specc plan` takes as the layer count grows: specs/gpt-tiny.yaml at TP=2 with sequence
parallelism, 12 to 2000 layers, and the same model with a repeated module nested inside each layer
(two MLPs per layer, `repeat:` inside `repeat:`). Planning must be linear in the layer count: the
time per layer stays about constant from 12 to 2000 layers (the 12-layer row carries the fixed
cost of loading the spec). Measures the pipeline in process (load, graph, passes, plan, text),
best of a few runs, and the command end to end (interpreter start included).

    python bench/plan_time.py [--quick]      # --quick: up to 500 layers
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from specc.compiler import load_and_compile  # noqa: E402
from specc.errors import Loc  # noqa: E402
from specc.frontend.model import Settings  # noqa: E402
from specc.plan import build_plan, plan_text  # noqa: E402

SPEC = os.path.join(ROOT, "specs", "gpt-tiny.yaml")
LAYERS = (12, 100, 250, 500, 1000, 2000)

NESTED = """name: gpt_tiny_nested
extends: {spec}
description: gpt-tiny with two MLPs per layer, a repeated module inside a repeated module
modules:
  TransformerLayer:
    inputs: [x]
    submodules:
      input_layernorm: {{op: layernorm, hidden_size: "${{hidden_size}}", eps: "${{layernorm_epsilon}}"}}
      self_attention: {{module: SelfAttention}}
      pre_mlp_layernorm: {{op: layernorm, hidden_size: "${{hidden_size}}", eps: "${{layernorm_epsilon}}"}}
      mlps: {{module: MLP, repeat: 2}}
    forward:
      - x = x + self_attention(input_layernorm(x))
      - x = x + mlps(pre_mlp_layernorm(x))
      - return x
"""


def in_process(spec: str, layers: int) -> float:
    best = float("inf")
    for _ in range(3 if layers <= 250 else 1):
        start = time.perf_counter()
        _, graph = load_and_compile(spec, Settings(tp=2, sp=True), [("num_layers", layers, Loc("--set"))])
        plan_text(build_plan(graph))
        best = min(best, time.perf_counter() - start)
    return best


def end_to_end(spec: str, layers: int) -> float:
    start = time.perf_counter()
    subprocess.run([sys.executable, "-m", "specc_cli", "plan", spec, "--tp", "2", "--sp", "--set", f"num_layers={layers}"],
                   cwd=ROOT, check=True, capture_output=True)
    return time.perf_counter() - start


def table(title: str, spec: str, layers: tuple) -> None:
    rows = [(n, in_process(spec, n), end_to_end(spec, n)) for n in layers]
    base = next((t / n for n, t, _ in rows if n >= 100), rows[0][1] / rows[0][0])
    print(title)
    print(f"{'layers':>6}  {'plan (in process)':>18}  {'per layer':>10}  {'vs 100-layer rate':>17}  {'specc plan (cli)':>16}"
          f"  {'cli per layer':>13}")
    for n, t, cli in rows:
        print(f"{n:>6}  {t:>16.2f} s  {t / n * 1000:>7.2f} ms  {t / n / base:>16.2f}x  {cli:>14.2f} s  "
              f"{cli / n * 1000:>10.2f} ms")
    print()


def main() -> None:
    layers = tuple(n for n in LAYERS if n <= 500) if "--quick" in sys.argv else LAYERS
    print("specc plan SPEC --tp 2 --sp --set num_layers=N\n")
    table("specs/gpt-tiny.yaml", SPEC, layers)
    with tempfile.TemporaryDirectory() as tmp:
        nested = os.path.join(tmp, "gpt-tiny-nested.yaml")
        with open(nested, "w", encoding="utf-8") as f:
            f.write(NESTED.format(spec=SPEC))
        table("gpt-tiny with a repeated module in each layer (layers.*.mlps.*)", nested, layers)


if __name__ == "__main__":
    main()
