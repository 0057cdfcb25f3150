import pytest
import torch
import torch.distributed as dist

from runtime.parallel_state import Group, ProcessGroups, _axis_rank_lists, _axis_sizes


def test_single_groups_need_no_distributed():
    assert not dist.is_initialized()
    pg = ProcessGroups.single()
    assert (pg.world_size, pg.rank) == (1, 0)
    for name in ("tp", "cp", "dp", "pp"):
        group = getattr(pg, name)
        assert group == Group(size=1, rank=0, group=None, ranks=(0,), name=name)
    pg.destroy()  # nothing was created; must not touch torch.distributed


def test_initialize_requires_distributed():
    with pytest.raises(RuntimeError, match="init_process_group"):
        ProcessGroups.initialize(tp=1)


def test_rank_layout_matches_megatron_example():
    # Megatron's documented example: 16 ranks, tp=2, pp=4 -> dp=2.
    sizes = _axis_sizes(16, tp=2, cp=1, pp=4, dp=None)
    assert sizes == {"tp": 2, "cp": 1, "dp": 2, "pp": 4}
    assert _axis_rank_lists("tp", sizes) == [(i, i + 1) for i in range(0, 16, 2)]
    assert _axis_rank_lists("pp", sizes) == [(0, 4, 8, 12), (1, 5, 9, 13), (2, 6, 10, 14), (3, 7, 11, 15)]
    assert _axis_rank_lists("dp", sizes) == [(0, 2), (1, 3), (4, 6), (5, 7), (8, 10), (9, 11), (12, 14), (13, 15)]


def test_rank_layout_all_axes():
    sizes = _axis_sizes(16, tp=2, cp=2, pp=2, dp=2)
    # tp innermost, then cp, dp, pp: rank = tp + 2*cp + 4*dp + 8*pp.
    assert _axis_rank_lists("cp", sizes)[:2] == [(0, 2), (1, 3)]
    assert _axis_rank_lists("dp", sizes)[:2] == [(0, 4), (1, 5)]
    assert _axis_rank_lists("pp", sizes)[:2] == [(0, 8), (1, 9)]
    for axis in ("tp", "cp", "dp", "pp"):
        lists = _axis_rank_lists(axis, sizes)
        assert sorted(r for ranks in lists for r in ranks) == list(range(16)), axis


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(tp=4), "not divisible by tp\\*cp\\*pp"),
        (dict(tp=2, cp=2, pp=2), "not divisible"),
        (dict(tp=2, dp=2), "does not equal the world size 6"),
        (dict(tp=0), "tp size must be a positive integer"),
        (dict(tp=2, dp=0), "dp size must be a positive integer"),
    ],
)
def test_bad_sizes_raise(kwargs, message):
    kwargs = {"cp": 1, "pp": 1, "dp": None, **kwargs}
    with pytest.raises(ValueError, match=message):
        _axis_sizes(6, **kwargs)


def _sum_of_ranks(group: Group) -> float:
    t = torch.tensor([float(dist.get_rank())])
    dist.all_reduce(t, group=group.group)
    return t.item()


def _check_initialize(rank, world):
    configs = [dict(tp=2), dict(tp=2, cp=2), dict(tp=2, pp=2), dict(pp=2, dp=2), dict(cp=4), dict(tp=4)]
    for config in configs:
        pg = ProcessGroups.initialize(**config)
        sizes = {k: config.get(k, 1) for k in ("tp", "cp", "pp")}
        sizes["dp"] = world // (sizes["tp"] * sizes["cp"] * sizes["pp"])
        assert (pg.world_size, pg.rank) == (world, rank)
        # Coordinates follow rank = tp + T*(cp + C*(dp + D*pp)).
        rest = rank
        for name in ("tp", "cp", "dp", "pp"):
            group = getattr(pg, name)
            assert group.size == sizes[name] and group.name == name, (config, name)
            assert group.rank == rest % sizes[name], (config, name)
            assert group.ranks[group.rank] == rank, (config, name)
            rest //= sizes[name]
            if group.size == 1:
                assert group.group is None and group.ranks == (rank,)
            else:
                # The process group really spans exactly `ranks`.
                assert _sum_of_ranks(group) == sum(group.ranks), (config, name)
        pg.destroy()
        pg.destroy()  # idempotent
    with pytest.raises(ValueError, match="not divisible"):
        ProcessGroups.initialize(tp=3)
    return True


def test_initialize_on_four_ranks(gloo):
    assert gloo.run(4, _check_initialize) == [True] * 4
