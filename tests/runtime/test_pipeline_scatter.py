"""The pipeline's scatter/gather over TP (runtime/pipeline.py; Narayanan et al. 2021, Section
4.1): at TP 2 x PP 2 without sequence parallelism the activation between the stages is
replicated over the TP ranks, so each sends its half of the last dim and the next stage
all-gathers it (the gradient likewise back). Losses and every gradient equal the unscattered
run's exactly (the slices reassemble the very tensors), and the stage's output is half the
width; with SP the boundary value is already sharded and is sent as it is."""

from __future__ import annotations

import os

import torch

from runtime.init import randomize_parameters
from runtime.parallel_state import ProcessGroups
from runtime.pipeline import scattered
from specc_torch.api import build_model

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
SPEC = os.path.join(ROOT, "specs", "gpt-tiny.yaml")
SEED, M = 7, 2


def _step(model, pg, scatter, tokens, labels):
    from runtime.pipeline import Pipeline

    pipe = Pipeline(model, pg, M, ("tokens", "labels"), scatter_gather=scatter)
    for p in model.parameters():
        p.grad = None
    loss = pipe.step([(tokens[i:i + 1], labels[i:i + 1]) for i in range(M)])
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    cuts = [(st.submod.scatter_out, st.submod.gather_in) for st in pipe.stages]
    # what the schedule sends and receives (torch's record of the stage's p2p tensors)
    shapes = [[tuple(t.shape) for t in (st._stage_meta.outputs if pg.pp.rank == 0 else st._stage_meta.inputs)]
              for st in pipe.stages]
    return loss, grads, cuts, shapes


def _scatter_against_whole(rank, world, sp):
    pg = ProcessGroups.initialize(tp=2, pp=2)
    try:
        model = build_model(SPEC, pg, micro_batch_size=1, sp=sp, pp=2,
                            overrides={"num_layers": 2, "hidden_dropout": 0.1, "attention_dropout": 0.1})
        randomize_parameters(model, SEED)
        gen = torch.Generator().manual_seed(SEED)
        tokens = torch.randint(0, 100, (M, 32), generator=gen)
        labels = torch.randint(0, 100, (M, 32), generator=gen)
        torch.manual_seed(SEED)
        scattered = _step(model, pg, True, tokens, labels)
        torch.manual_seed(SEED)
        whole = _step(model, pg, False, tokens, labels)
        return scattered, whole, pg.pp.rank
    finally:
        pg.destroy()


def test_pipeline_scatter_gather_equals_whole_sends(gloo):
    for (loss, grads, cuts, shapes), (loss0, grads0, cuts0, shapes0), pp_rank in \
            gloo.run(4, _scatter_against_whole, False):
        # the very numbers: the slices reassemble the replicated tensors, forward and backward
        assert torch.equal(loss, loss0)
        assert grads and grads.keys() == grads0.keys()
        for name in grads:
            assert torch.equal(grads[name], grads0[name]), name
        # the first stage scatters what it sends, the second gathers what it receives
        assert cuts == ([([True], [])] if pp_rank == 0 else [([], [True])]), cuts
        assert cuts0 == [([], [])]  # scatter_gather=False: whole tensors
        assert shapes == [[(32, 1, 32)]] and shapes0 == [[(32, 1, 64)]]  # [s, b, h/t] against [s, b, h]


class _Tp:
    size = 2


def test_only_tp_replicated_values_are_scattered():
    h = [32, 1, 64]
    assert scattered([("h", h, "I", 0)], _Tp) == [True]
    assert scattered([("h", h, "tp:I/cp:S(s)", 0)], _Tp) == [True]  # CP without SP: replicated over tp
    assert scattered([("h", h, "S(s)", 0)], _Tp) == [False]  # sequence parallel: already 1/t a rank
    assert scattered([("h", h, "tp:S(s)/cp:S(s)", 0)], _Tp) == [False]
    assert scattered([("h", [32, 1, 63], "I", 0)], _Tp) == [False]  # a last dim t does not divide
    _Tp1 = type("Tp1", (), {"size": 1})
    assert scattered([("h", h, "I", 0)], _Tp1) == [False]
