"""What `specc verify` is asked (VerifyConfig, the mutations that show a check can fail) and what
it answers (one Row per comparison). specc_torch/verify.py runs it."""

from __future__ import annotations

import re
from dataclasses import dataclass, field

# Mutations break a compiled module on purpose, to show that verify catches each kind of bug.
MUTATIONS = {
    "drop-partial-grad": "forget the TP all-reduce of the first tp-partial gradient (e.g. an SP norm weight)",
    "one-slab-segments": "shard a fused weight (QKV, gate+up) as one slab instead of per segment",
    "drop-reduction": "replace the first reduction of partial sums by a plain split (a missing all-reduce)",
    "drop-cp-partial-grad": "forget the CP all-reduce of the first cp-partial gradient (a parameter used on "
                            "context-parallel chunks)",
    "bias-on-every-rank": "add the first one-rank bias to the partial sums on every rank (its gradient still "
                          "taken once): right while the bias is zero, as in the initial weights",
}


@dataclass
class VerifyConfig:
    spec: str
    tps: list
    sps: list
    steps: int = 2
    seed: int = 1234
    batch: int = 2
    overrides: dict = field(default_factory=dict)
    lr: float = 0.1
    tolerance: float = 1e-4  # pass: max |a - b| <= atol + tolerance * max |b|, per tensor
    atol: float = 1e-6
    mutate: str | None = None
    tp_invariant_dropout: bool = False  # exact comparison with dropout on (masks drawn full-size)
    mask_draws: int = 32  # dropout on, statistical mode: independent masks per side
    cps: list = field(default_factory=lambda: [1])  # context-parallel sizes
    cp_comm_types: list = field(default_factory=lambda: ["auto"])  # attention over CP: p2p, all_gather, auto
    torch_compile: str | None = None  # a torch.compile backend for the checked models' layers (the reference is eager)
    eps: list = field(default_factory=lambda: [1])  # expert-model-parallel sizes (carved out of the DP ranks)
    # activation recompute of the compiled models (Settings' recompute fields); the reference never
    # recomputes, so a pass shows recompute changes nothing
    recompute: dict = field(default_factory=dict)
    # Settings' reset_position_ids and reset_attention_mask, of every model (the reference too): the
    # models take position and document ids, drawn as the spec's other inputs are
    packed: dict = field(default_factory=dict)

    pps: list = field(default_factory=lambda: [1])  # pipeline sizes (each with every TP/CP setting)
    pp_virtual: list = field(default_factory=lambda: [None])  # layers per virtual stage (None: not interleaved)
    dps: list = field(default_factory=lambda: [1])  # data-parallel sizes of the pipeline settings
    pp_schedule: str | None = None  # runtime.pipeline.SCHEDULES; None: 1F1B, interleaved 1F1B with V > 1
    pp_settings: list | None = None  # explicit (pp, layers per virtual stage, tp, cp, sp) instead of every combination

    @property
    def data_parallel(self) -> bool:
        """With expert parallelism every DP rank gets its own batches (the EP group's ranks must hold
        different tokens for the all-to-alls to be tested), and gradients are averaged over DP."""
        return max(self.eps) > 1


@dataclass
class Row:
    setting: str
    quantity: str
    abs_err: float
    rel_err: float
    ok: bool
    detail: str = ""


def mutate_source(source: str, mutation: str):
    """(broken source, whether the mutation found something to break)."""
    if mutation == "drop-partial-grad":
        out, n = re.subn(r"^\s*runtime\.mark_tp_partial_grad\(.*\n", "", source, count=1, flags=re.M)
    elif mutation == "drop-cp-partial-grad":
        out, n = re.subn(r'^\s*runtime\.mark_partial_grad\(.*"cp".*\n', "", source, count=1, flags=re.M)
    elif mutation == "one-slab-segments":
        out, n = re.subn(r", segments=\[[0-9, ]+\](, heads=\[[0-9, ]+\])?", "", source, count=1)
    elif mutation == "drop-reduction":
        out, n = re.subn(r"mappings\.(reduce_scatter_to_sequence_parallel_region|reduce_from_tensor_model_parallel_region)"
                         r"\((\w+), self\.tp\)", lambda m: f"mappings.scatter_to_sequence_parallel_region({m.group(2)}, self.tp)"
                         if "scatter" in m.group(1) else m.group(2), source, count=1)
    elif mutation == "bias-on-every-rank":
        out, n = re.subn(r"(self\.[\w.]+) \* float\(self\.tp\.rank == 0\)",
                         r"(\1 if self.tp.rank == 0 else \1.detach())", source, count=1)
    else:
        raise ValueError(f"unknown mutation {mutation!r}; known: {', '.join(MUTATIONS)}")
    return out, n > 0
