"""Training samples: split by documents as Megatron rounds it, seeded windows across document
boundaries that cover each epoch's documents, blends drawn to their weights, mock data from the
seed alone, Megatron's --data-path list, and each DP rank reading only its own samples."""

from __future__ import annotations

import numpy as np
import pytest

from runtime.data import (
    BlendedDataset,
    DataError,
    IndexedDatasetBuilder,
    build_datasets,
    parse_blend,
    split_documents,
)


def _corpus(path, lengths, base=0) -> str:
    """Document d holds base + d * 1000 + 0, 1, 2, ...: every token says where it came from."""
    builder = IndexedDatasetBuilder(str(path) + ".bin", np.int32)
    for d, n in enumerate(lengths):
        builder.add_item(base + d * 1000 + np.arange(n))
        builder.end_document()
    builder.finalize(str(path) + ".idx")
    return str(path)


@pytest.fixture(scope="module")
def numbered(tmp_path_factory):
    rng = np.random.default_rng(0)
    return _corpus(tmp_path_factory.mktemp("numbered") / "c", rng.integers(0, 60, size=100))


def test_split_is_by_documents_rounded_as_megatron():
    assert split_documents(100, (0.969, 0.03, 0.001)) == {"train": (0, 97), "valid": (97, 100), "test": (100, 100)}
    assert split_documents(20, (0.969, 0.03, 0.001)) == {"train": (0, 19), "valid": (19, 20), "test": (20, 20)}
    # each share rounded (1.5 -> 2, twice), the excess taken off every bound after the first
    assert split_documents(3, (0.5, 0.5, 0.0)) == {"train": (0, 1), "valid": (1, 3), "test": (3, 3)}


def test_samples_cross_documents_and_cover_each_epoch(numbered):
    sets = build_datasets(numbered, seq_length=16, seed=7, weights=(0.8, 0.2, 0.0))
    train, valid = sets["train"], sets["valid"]
    assert (train.first, train.end, valid.first, valid.end) == (0, 80, 80, 100)
    n = len(train)
    assert n == (train.num_tokens - 1) // 16
    seen = []
    for j in range(n):
        s = train.sample(j)
        assert len(s) == 17 and s.dtype == np.int64 and all(80 > t // 1000 for t in s)
        for a, b in zip(s[:-1], s[1:]):  # the next token of its document, or the start of another
            assert b == a + 1 or b % 1000 == 0
        seen.extend(s[:-1].tolist())
    assert len(set(seen)) == n * 16  # one epoch: disjoint windows of the epoch's stream
    assert all(80 <= t // 1000 < 100 for j in range(len(valid)) for t in valid.sample(j))
    again = build_datasets(numbered, 16, 7, (0.8, 0.2, 0.0))["train"]
    other = build_datasets(numbered, 16, 8, (0.8, 0.2, 0.0))["train"]
    assert all(np.array_equal(train.sample(j), again.sample(j)) for j in range(2 * n))
    assert not all(np.array_equal(train.sample(j), other.sample(j)) for j in range(20))
    second = [train.sample(n + j).tolist() for j in range(n)]  # epoch 2: another order of the documents
    assert second != [train.sample(j).tolist() for j in range(n)]
    assert len({t for s in second for t in s[:-1]}) == n * 16


def test_a_blend_draws_to_its_weights_from_each_dataset_in_turn(tmp_path, numbered):
    other = _corpus(tmp_path / "o", [50] * 40, base=10_000_000)
    blend = build_datasets(["0.3", numbered, "0.7", other], 16, 1, (1.0, 0.0, 0.0))["train"]
    assert isinstance(blend, BlendedDataset)
    sources = [blend.source(j) for j in range(1000)]
    counts = np.cumsum([[k == 0, k == 1] for k, _ in sources], axis=0)
    expected = np.outer(np.arange(1, 1001), [0.3, 0.7])
    assert np.abs(counts - expected).max() <= 1  # within one sample of the weights, all along
    for k in (0, 1):  # each dataset's own samples, in its own order
        assert [i for kk, i in sources if kk == k] == list(range(int(counts[-1, k])))
    assert all(blend.sample(j)[0] >= 10_000_000 for j, (k, _) in enumerate(sources[:50]) if k == 1)
    unweighted = build_datasets([numbered, other], 16, 1, (1.0, 0.0, 0.0))["train"]
    tokens = [d.num_tokens for d in unweighted.datasets]  # prefixes alone: by their sizes
    assert unweighted.weights == pytest.approx([t / sum(tokens) for t in tokens])


def test_a_dataset_per_split_is_read_whole(tmp_path, numbered):
    other = _corpus(tmp_path / "o", [50] * 4, base=10_000_000)
    sets = build_datasets(None, 16, 1, (0.5, 0.5, 0.0), split_paths={"train": numbered, "valid": other, "test": None})
    assert (sets["train"].first, sets["train"].end) == (0, 100) and (sets["valid"].first, sets["valid"].end) == (0, 4)
    assert all(sets["valid"].sample(j)[0] >= 10_000_000 for j in range(len(sets["valid"])))
    assert len(sets["test"]) == 0
    with pytest.raises(DataError, match="the test split has no sample"):
        sets["test"].sample(0)


def test_data_path_lists_as_megatron_reads_them():
    assert parse_blend("a") == [(None, "a")]
    assert parse_blend(["a", "b", "c"]) == [(None, "a"), (None, "b"), (None, "c")]
    assert parse_blend(["0.3", "a", "0.7", "b"]) == [(0.3, "a"), (0.7, "b")]
    assert parse_blend(["a", "b"]) == [(None, "a"), (None, "b")]
    for bad, message in [(["0.3", "a", "b", "0.7"], "blend weight 'b' is not a number"),
                         (["0.3", "a", "0.7"], "3 values; a blend is WEIGHT PREFIX pairs"),
                         (["-1", "a", "2", "b"], "blend weight -1 must be a finite number at least 0"),
                         (["0", "a", "0", "b"], "the blend weights add up to 0")]:
        with pytest.raises(DataError, match=message):
            parse_blend(bad)


def test_blend_and_split_weights_whose_sum_overflows_are_refused_not_made_equal(tmp_path, numbered):
    # 1.5e308 + 0.5e308 is inf: normalized, both weights became 0 (or nan) and the blend drew 50/50
    with pytest.raises(DataError) as e:
        parse_blend(["1.5e308", "a", "0.5e308", "b"])
    assert str(e.value) == ("--data-path: the blend weights 1.5e308, 0.5e308 add up to more than the largest float "
                            "(inf); scale them down, only their ratios count")
    with pytest.raises(DataError, match=r"weights 1e308, 1e308, 1e308, 1e308, \.\.\. add up to more"):
        parse_blend([x for i in range(5) for x in ("1e308", f"p{i}")])
    for bad, message in [(["inf", "a", "1", "b"], "blend weight inf must be a finite number at least 0"),
                         (["nan", "a", "1", "b"], "blend weight nan must be a finite number at least 0"),
                         (["1", "a", "-0.5", "b"], "blend weight -0.5 must be a finite number at least 0"),
                         (["0", "a", "0.0", "b"], "the blend weights add up to 0")]:
        with pytest.raises(DataError, match=message):
            parse_blend(bad)
    assert parse_blend(["1.5e307", "a", "0.5e307", "b"]) == [(1.5e307, "a"), (0.5e307, "b")]  # large is fine
    other = _corpus(tmp_path / "o", [50] * 40, base=10_000_000)
    big = build_datasets(["1.5e307", numbered, "0.5e307", other], 16, 1, (1.0, 0.0, 0.0))["train"]
    assert big.weights == pytest.approx([0.75, 0.25])
    parts = big.datasets
    with pytest.raises(DataError, match="their sum finite"):  # the class itself, given them directly
        BlendedDataset(parts, [1.5e308, 0.5e308], "train")
    # --split: the same overflow made every split's share 0
    from runtime.train.config import split_weights

    with pytest.raises(ValueError, match=r"^the weights add up to more than the largest float \(inf\)"):
        split_weights("1.5e308,0.5e308,1")
    assert split_weights("1.5e307,0.5e307") == pytest.approx((0.75, 0.25, 0.0))


def test_mock_data_comes_from_the_seed_alone():
    mock = build_datasets(None, 32, 5, (0.9, 0.1, 0.0), mock=True, vocab_size=300)
    again = build_datasets(None, 32, 5, (0.9, 0.1, 0.0), mock=True, vocab_size=300)["train"]
    other = build_datasets(None, 32, 6, (0.9, 0.1, 0.0), mock=True, vocab_size=300)["train"]
    rows = np.stack([mock["train"].sample(j) for j in range(64)])
    assert rows.shape == (64, 33) and rows.min() >= 0 and rows.max() < 300 and rows.max() > 250
    assert np.array_equal(rows, np.stack([again.sample(j) for j in range(64)]))
    assert not np.array_equal(rows, np.stack([other.sample(j) for j in range(64)]))
    assert len(mock["valid"]) > 0
    with pytest.raises(DataError, match="--mock-data needs the model's vocabulary size"):
        build_datasets(None, 32, 5, (1.0, 0.0, 0.0), mock=True)


def test_each_dp_rank_reads_only_its_own_samples(numbered):
    ds = build_datasets(numbered, 8, 1, (1.0, 0.0, 0.0))["train"]
    read = []
    original = ds.sample
    ds.sample = lambda j: (read.append(j), original(j))[1]
    mbs, dp, consumed = 3, 2, 60
    per_rank = {}
    for r in range(dp):
        read.clear()
        rows = [ds.micro_batch(consumed, m, mbs, r, dp) for m in range(2)]
        per_rank[r] = list(read)
        for tokens, labels in rows:
            assert tokens.shape == labels.shape == (mbs, 8)
            assert np.array_equal(tokens[:, 1:], labels[:, :-1])
    assert not set(per_rank[0]) & set(per_rank[1])
    read.clear()
    for m in range(4):  # DP=1 with twice the micro-batches reads the same global batch
        ds.micro_batch(consumed, m, mbs, 0, 1)
    assert sorted(read) == sorted(per_rank[0] + per_rank[1]) == list(range(60, 72))
