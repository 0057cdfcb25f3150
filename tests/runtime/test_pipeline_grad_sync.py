"""The data-parallel reduction at PP > 1 overlaps the schedule (runtime/ddp.py final_backward,
runtime/pipeline.py): each stage's last backward of the step starts the buckets it finished, as
Megatron's per-chunk gradient sync does, and a bucket holding the weight tied across the first and
last stage waits for the tied sum. On PP 2 x DP 2 (4 gloo ranks), for 1F1B, interleaved 1F1B and
interleaved zero-bubble, with the replicated and the distributed optimizer's reduction: every
bucket but the held ones starts inside a stage's last backward, before the schedule returns, and
the reduced gradients are bit-equal to reducing every bucket after the schedule
(--no-overlap-grad-reduce). And zero-bubble's weight pass, which assigns .grad instead of
accumulating it, hands its gradients to the buffer (they were lost before)."""

from __future__ import annotations

import os

import pytest
import torch

from runtime.ddp import DistributedDataParallel
from runtime.grads import finalize_model_grads
from runtime.init import randomize_parameters
from runtime.parallel_state import ProcessGroups
from specc_torch.api import build_model

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
SPEC = os.path.join(ROOT, "specs", "gpt-tiny.yaml")
SEED, M = 11, 4
CASES = [("1f1b", None), ("interleaved_1f1b", 1), ("interleaved_zero_bubble", 1)]


def _step(pg, schedule, vpp, mode, overlap, tokens, labels):
    """One pipeline step; the events of the DDP (final-backward windows, bucket launches) and the
    reduced gradient buffer."""
    from runtime.pipeline import Pipeline

    model = build_model(SPEC, pg, micro_batch_size=1, pp=2, pp_virtual_stage_layers=vpp,
                        overrides={"num_layers": 4, "hidden_dropout": 0.0, "attention_dropout": 0.0})
    randomize_parameters(model, SEED)
    ddp = DistributedDataParallel(model, pg, bucket_size=3_000, grad_reduce=mode, overlap_grad_reduce=overlap)
    events = []
    launch, final = ddp._launch, ddp.final_backward

    def logged_launch(bucket):
        events.append(("launch", bucket.index))
        return launch(bucket)

    class logged_final:
        def __enter__(self):
            events.append(("final", None))
            self.inner = final()
            return self.inner.__enter__()

        def __exit__(self, *exc):
            events.append(("end", None))
            return self.inner.__exit__(*exc)

    ddp._launch, ddp.final_backward = logged_launch, logged_final
    pipe = Pipeline(model, pg, M, ("tokens", "labels"), schedule=schedule, ddp=ddp)
    ddp.zero_grad_buffer()
    with ddp.no_sync():
        loss = pipe.step([(tokens[i:i + 1], labels[i:i + 1]) for i in range(M)])
    events.append(("schedule done", None))
    finalize_model_grads(model, pg, ddp)
    held = [b.index for b in ddp.buckets if b.held]
    return loss, ddp.grad_buffer.clone(), events, held, len(ddp.buckets)


def _overlapped_against_after(rank, world):
    pg = ProcessGroups.initialize(tp=1, pp=2)
    try:
        assert pg.dp.size == 2
        gen = torch.Generator().manual_seed(SEED + pg.dp.rank)  # each DP rank its own batch
        tokens = torch.randint(0, 100, (M, 32), generator=gen)
        labels = torch.randint(0, 100, (M, 32), generator=gen)
        out = {}
        for schedule, vpp in CASES:
            for mode in ("all_reduce", "reduce_scatter"):
                out[schedule, mode] = (_step(pg, schedule, vpp, mode, True, tokens, labels),
                                       _step(pg, schedule, vpp, mode, False, tokens, labels))
        return pg.pp.rank, out
    finally:
        pg.destroy()


def _windows(events) -> list:
    """For each launch, whether it came inside a final-backward window, and the number of windows
    opened before it."""
    inside, opened, out = False, 0, []
    for kind, index in events:
        if kind == "final":
            inside, opened = True, opened + 1
        elif kind == "end":
            inside = False
        elif kind == "launch":
            out.append((index, inside, opened))
        elif kind == "schedule done":
            out.append(("done", inside, opened))
    return out


@pytest.fixture(scope="module")
def runs(gloo):
    return gloo.run(4, _overlapped_against_after, )


def test_every_bucket_but_the_tied_ones_starts_inside_a_stages_last_backward(runs):
    for pp_rank, out in runs:
        for (schedule, mode), ((_, _, events, held, n), _) in out.items():
            where = _windows(events)
            done = [i for i, w in enumerate(where) if w[0] == "done"][0]
            during, after = where[:done], where[done + 1:]
            chunks = 2 if schedule.startswith("interleaved") else 1
            assert where[done][2] == chunks, (schedule, where)  # one last backward per stage of this rank
            assert n >= 4 and held, (schedule, n, held)  # several buckets; the tied weight's is held
            # every bucket but the held ones started during the schedule, inside a last backward
            assert sorted(i for i, _, _ in during) == [i for i in range(n) if i not in held], (schedule, mode, where)
            assert all(inside for _, inside, _ in during), (schedule, mode, where)
            assert sorted(i for i, _, _ in after) == held  # the held ones after the tied sum
            if chunks == 2:  # the later chunk's buckets start before the earlier chunk's last backward
                assert any(opened == 1 for _, _, opened in during), (schedule, where)


def test_overlapped_reduction_equals_the_reduction_after_the_schedule(runs):
    for pp_rank, out in runs:
        for (schedule, mode), ((loss, grads, _, _, _), (loss0, grads0, events0, _, _)) in out.items():
            # --no-overlap-grad-reduce: every bucket starts after the schedule
            assert [kind for kind, _ in events0 if kind in ("launch", "schedule done")][0] == "schedule done"
            assert torch.equal(loss, loss0), (schedule, mode)
            assert grads.abs().sum() > 0
            assert torch.equal(grads, grads0), (schedule, mode, pp_rank)


def test_zero_bubble_weight_pass_gradients_reach_the_buffer(runs):
    # torch's zero-bubble weight pass assigns .grad (no post-accumulate hook runs): its gradients
    # must still land in the DDP's buffer, equal to interleaved 1F1B's (the same sums over the same
    # micro-batches, computed by autograd.grad in two halves: fp32 rounding apart)
    for pp_rank, out in runs:
        for mode in ("all_reduce", "reduce_scatter"):
            (_, zb, _, _, _), _ = out["interleaved_zero_bubble", mode]
            (_, ref, _, _, _), _ = out["interleaved_1f1b", mode]
            scale = ref.abs().max()
            assert scale > 0 and (zb - ref).abs().max() <= 1e-5 * scale, (mode, pp_rank, (zb - ref).abs().max(), scale)
