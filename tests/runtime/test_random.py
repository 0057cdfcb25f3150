import pytest
import torch

from runtime.random import RNGTracker


def draw(tracker, stream, n=8):
    with tracker.fork(stream):
        return torch.rand(n)


def test_default_stream_is_shared_and_tp_stream_is_per_rank():
    rank0, rank1 = RNGTracker(seed=42, tp_rank=0), RNGTracker(seed=42, tp_rank=1)
    assert torch.equal(draw(rank0, "default"), draw(rank1, "default"))
    assert not torch.equal(draw(rank0, "tensor-parallel"), draw(rank1, "tensor-parallel"))
    # Megatron's seeding: default from seed, tensor-parallel from seed + 2718 + tp_rank.
    assert torch.equal(draw(RNGTracker(7, 0), "default"), torch.rand(8, generator=torch.Generator().manual_seed(7)))
    expected = torch.rand(8, generator=torch.Generator().manual_seed(7 + 2718 + 3))
    assert torch.equal(draw(RNGTracker(7, 3), "tensor-parallel"), expected)


def test_streams_advance_and_restore_torch_state():
    tracker = RNGTracker(seed=1, tp_rank=0)
    torch.manual_seed(123)
    outside_before = torch.rand(4)
    torch.manual_seed(123)
    first = draw(tracker, "default")
    outside_after = torch.rand(4)
    assert torch.equal(outside_before, outside_after)  # the fork did not consume torch's stream
    second = draw(tracker, "default")
    assert not torch.equal(first, second)  # the stream advanced
    fresh = RNGTracker(seed=1, tp_rank=0)
    assert torch.equal(torch.cat([draw(fresh, "default"), draw(fresh, "default")]), torch.cat([first, second]))


def test_state_restored_when_the_block_raises():
    tracker = RNGTracker(seed=1, tp_rank=0)
    state = torch.get_rng_state()
    with pytest.raises(RuntimeError, match="inside"):
        with tracker.fork("default"):
            torch.rand(3)
            raise RuntimeError("inside")
    assert torch.equal(torch.get_rng_state(), state)
    draw(tracker, "default")  # the stream is usable again


def test_nested_forks():
    tracker = RNGTracker(seed=1, tp_rank=0)
    with tracker.fork("default"):
        with tracker.fork("tensor-parallel"):
            inner = torch.rand(4)
        outer = torch.rand(4)
        with pytest.raises(RuntimeError, match="already forked"):
            with tracker.fork("default"):
                pass
    fresh = RNGTracker(seed=1, tp_rank=0)
    assert torch.equal(inner, draw(fresh, "tensor-parallel", n=4))
    assert torch.equal(outer, draw(fresh, "default", n=4))


def test_checkpoint_round_trip_and_errors():
    tracker = RNGTracker(seed=9, tp_rank=2)
    draw(tracker, "tensor-parallel")
    saved = tracker.get_states()
    expected = draw(tracker, "tensor-parallel")
    draw(tracker, "default")
    tracker.set_states(saved)
    assert torch.equal(draw(tracker, "tensor-parallel"), expected)
    with pytest.raises(KeyError, match="unknown RNG stream 'expert'"):
        draw(tracker, "expert")
    tracker.add("expert", 5)
    assert torch.equal(draw(tracker, "expert"), torch.rand(8, generator=torch.Generator().manual_seed(5)))
    with pytest.raises(ValueError, match="already exists"):
        tracker.add("default", 1)
