"""Training samples from Megatron indexed datasets (Megatron's GPTDataset and BlendedDataset idea),
seeded, so that every rank computes the same order without communicating and a run resumes from
its consumed-sample count.

Split (--split 969,30,1): each dataset's documents, in file order, are cut into contiguous train,
valid and test ranges by weight, as Megatron's get_split_indices rounds them.

Samples (GPTDataset): a sample is seq_length + 1 consecutive tokens (input = sample[:-1], labels
= sample[1:]) of the split's documents laid end to end, across document boundaries (the EOD
token that `specc data prepare` appends marks them). Epoch e lays the documents in the order of
a permutation drawn from (seed, dataset, split, e) and cuts the stream into (T - 1) // seq_length
samples (T: the split's tokens; the tail shorter than a sample is left out), which it visits in a
second permutation from the same generator. Sample j is sample j mod n of epoch j div n: as many
epochs as the run consumes.

Blend (--data-path 0.3 A 0.7 B): sample j of the blend comes from the dataset whose share so far
lags its weight most (Megatron's build_blending_indices: argmax_k w_k * max(j, 1) - taken_k, the
first on ties), and is that dataset's next sample. Prefixes without weights blend by their
token counts.

Per-split datasets (--train-data-path, --valid-data-path, --test-data-path, Megatron's): each
split reads all documents of its own prefix (or blend), --split aside.

Mock data (--mock-data): 100,000 documents of 1 .. 2 x seq_length tokens, lengths and tokens
drawn from the seed (uniform ids below the vocabulary size); no files.

Each step consumes one global batch. Data-parallel rank r reads, for micro-batch m, the samples
consumed + (m * DP + r) * mbs ... + mbs - 1 and nothing else; with DP = 1 and DP times as many
micro-batches the global batch is the same set of samples. Tensor- and context-parallel ranks of
one DP rank read the same samples.
"""

from __future__ import annotations

import os

import numpy as np

from .errors import DataError
from .indexed import IndexedDataset

SPLITS = ("train", "valid", "test")


def split_documents(num_documents: int, weights) -> dict:
    """{split: (first, end)} document ranges for normalized (train, valid, test) weights, rounded
    as Megatron's get_split_indices."""
    bounds = [0]
    for w in weights:
        bounds.append(bounds[-1] + int(round(w * float(num_documents))))
    diff = bounds[-1] - num_documents
    bounds = [0] + [max(0, b - diff) for b in bounds[1:]]
    return {name: (bounds[i], bounds[i + 1]) for i, name in enumerate(SPLITS)}


def parse_blend(data_path) -> list:
    """[(weight or None, prefix)] from Megatron's --data-path list: PREFIX, PREFIX PREFIX ..., or
    WEIGHT PREFIX WEIGHT PREFIX ... (a str is one prefix)."""
    if data_path is None:
        return []
    items = [data_path] if isinstance(data_path, str) else [str(p) for p in data_path]
    if not items:
        raise DataError("--data-path: give a dataset prefix, or WEIGHT PREFIX pairs")
    if len(items) % 2 == 1:
        numbers = [p for p in items if _number(p) is not None]
        if numbers and len(items) > 1:
            raise DataError(f"--data-path {' '.join(items)}: {len(items)} values; a blend is WEIGHT PREFIX pairs "
                            f"(e.g. --data-path 0.3 A 0.7 B), or prefixes alone")
        return [(None, p) for p in items]
    weights = [_number(w) for w in items[0::2]]
    if all(w is None for w in weights) and all(_number(p) is None for p in items[1::2]):
        return [(None, p) for p in items]  # prefixes alone
    blend = []
    for w, raw, prefix in zip(weights, items[0::2], items[1::2]):
        if w is None:
            raise DataError(f"--data-path: blend weight {raw!r} is not a number (a blend is WEIGHT PREFIX pairs, "
                            f"e.g. --data-path 0.3 A 0.7 B)")
        if not np.isfinite(w) or w < 0:
            raise DataError(f"--data-path: blend weight {raw} must be a finite number at least 0")
        blend.append((w, prefix))
    total = sum(w for w, _ in blend)
    if not np.isfinite(total):  # each is finite, the sum is not: normalized they would all be 0 (or nan)
        raise DataError(f"--data-path: the blend weights {', '.join(items[0::2][:4])}{', ...' if len(blend) > 4 else ''} "
                        "add up to more than the largest float (inf); scale them down, only their ratios count")
    if total <= 0:
        raise DataError("--data-path: the blend weights add up to 0")
    return blend


def _number(text: str):
    try:
        return float(text)
    except ValueError:
        return None


def open_dataset(prefix: str) -> IndexedDataset:
    """The indexed dataset at PREFIX (PREFIX.bin / PREFIX.idx given for PREFIX is accepted)."""
    if prefix.endswith((".bin", ".idx")) and os.path.isfile(prefix[:-4] + ".bin") \
            and os.path.isfile(prefix[:-4] + ".idx"):
        prefix = prefix[:-4]
    return IndexedDataset(prefix)


class MockDataset:
    """--mock-data: documents whose lengths and tokens come from the seed alone."""

    def __init__(self, vocab_size: int, seq_length: int, seed: int, num_documents: int = 100_000):
        self.prefix = "--mock-data"
        self.vocab_size, self.seed = int(vocab_size), int(seed)
        rng = np.random.default_rng([self.seed, 0x6D6F636B])
        self.document_lengths = rng.integers(1, 2 * seq_length + 1, size=num_documents).astype(np.int64)
        self.num_tokens = int(self.document_lengths.sum())

    @property
    def num_documents(self) -> int:
        return len(self.document_lengths)

    def document(self, d: int) -> np.ndarray:
        rng = np.random.default_rng([self.seed, 0x6D6F636B, int(d)])
        return rng.integers(0, self.vocab_size, size=int(self.document_lengths[d]), dtype=np.int64)

    def token_range(self, d: int, lo: int, hi: int) -> np.ndarray:
        return self.document(d)[lo:hi]


class GPTDataset:
    """Samples of seq_length + 1 tokens from documents [first, end) of `corpus` (module doc)."""

    def __init__(self, corpus, documents: tuple, seq_length: int, seed: int, split: str, index: int = 0):
        self.corpus, self.seq_length, self.seed, self.split, self.index = corpus, seq_length, seed, split, index
        self.split_id = SPLITS.index(split)
        self.first, self.end = documents
        self.lengths = np.asarray(corpus.document_lengths[self.first:self.end], dtype=np.int64)
        self.num_documents = self.end - self.first
        self.num_tokens = int(self.lengths.sum())
        self.num_samples = max(0, (self.num_tokens - 1) // seq_length)
        self._epoch = -1

    def __len__(self) -> int:
        return self.num_samples

    def _order(self, epoch: int) -> None:
        if epoch == self._epoch:
            return
        rng = np.random.default_rng([self.seed, self.index, self.split_id, epoch])
        order = rng.permutation(self.num_documents)
        self._docs = order + self.first
        self._ends = np.cumsum(self.lengths[order])
        self._samples = rng.permutation(self.num_samples)
        self._epoch = epoch

    def sample(self, j: int) -> np.ndarray:
        if self.num_samples == 0:
            raise DataError(f"{self.corpus.prefix}: the {self.split} split has no sample of {self.seq_length + 1} "
                            "tokens")
        epoch, i = divmod(int(j), self.num_samples)
        self._order(epoch)
        start = int(self._samples[i]) * self.seq_length
        stop = start + self.seq_length + 1
        d = int(np.searchsorted(self._ends, start, side="right"))
        pieces, pos = [], start
        while pos < stop:
            doc_end = int(self._ends[d])
            doc_start = doc_end - int(self.lengths[self._docs[d] - self.first])
            upto = min(stop, doc_end)
            pieces.append(self.corpus.token_range(int(self._docs[d]), pos - doc_start, upto - doc_start))
            pos, d = upto, d + 1
        return np.concatenate(pieces).astype(np.int64, copy=False)

    def micro_batch(self, consumed: int, micro: int, micro_batch_size: int, dp_rank: int, dp_size: int):
        return _micro_batch(self, consumed, micro, micro_batch_size, dp_rank, dp_size)


class BlendedDataset:
    """Samples drawn from several datasets to match normalized weights (module doc)."""

    def __init__(self, datasets: list, weights: list, split: str):
        total = float(sum(weights))
        if not np.isfinite(total) or any(not np.isfinite(w) or w < 0 for w in weights):  # parse_blend refuses them
            raise DataError(f"blend weights {list(weights)}: each must be finite and at least 0, and their sum finite")
        shares = [w / total for w in weights] if total > 0 else [1.0 / len(weights)] * len(weights)
        self.datasets, self.weights, self.split = datasets, shares, split
        self.seq_length = datasets[0].seq_length
        self._which: list = []
        self._index: list = []
        self._taken = [0] * len(datasets)

    def __len__(self) -> int:
        return sum(len(d) for d in self.datasets)

    def _extend(self, upto: int) -> None:
        weights, taken, which, index = self.weights, self._taken, self._which, self._index
        for j in range(len(which), upto + 1):
            scale = max(j, 1)
            best, best_error = 0, weights[0] * scale - taken[0]
            for k in range(1, len(weights)):
                error = weights[k] * scale - taken[k]
                if error > best_error:
                    best, best_error = k, error
            which.append(best)
            index.append(taken[best])
            taken[best] += 1

    def source(self, j: int) -> tuple:
        """(dataset number, its sample number) of blend sample j."""
        if j >= len(self._which):
            self._extend(max(j, 2 * len(self._which)))
        return self._which[j], self._index[j]

    def sample(self, j: int) -> np.ndarray:
        k, i = self.source(int(j))
        return self.datasets[k].sample(i)

    def micro_batch(self, consumed: int, micro: int, micro_batch_size: int, dp_rank: int, dp_size: int):
        return _micro_batch(self, consumed, micro, micro_batch_size, dp_rank, dp_size)


def _micro_batch(dataset, consumed: int, micro: int, micro_batch_size: int, dp_rank: int, dp_size: int):
    """(tokens, labels) int64 arrays [mbs, seq] for this DP rank's micro-batch `micro` of the
    global batch that starts at sample `consumed`."""
    first = consumed + (micro * dp_size + dp_rank) * micro_batch_size
    rows = np.stack([dataset.sample(first + i) for i in range(micro_batch_size)])
    return rows[:, :-1], rows[:, 1:]


def open_corpora(data_path, seq_length: int, seed: int, mock: bool = False, vocab_size: int | None = None) -> list:
    """[(weight or None, corpus)] for --data-path (or --mock-data)."""
    if mock:
        if vocab_size is None:
            raise DataError("--mock-data needs the model's vocabulary size")
        return [(None, MockDataset(vocab_size, seq_length, seed))]
    blend = parse_blend(data_path)
    if not blend:
        raise DataError("give --data-path PREFIX (or --mock-data)")
    corpora = []
    for w, prefix in blend:
        try:
            corpora.append((w, open_dataset(prefix)))
        except DataError as e:
            raise DataError(f"--data-path {e}") from None
    return corpora


class _NoData:
    """A split without a dataset (--valid-data-path or --test-data-path not given)."""

    def __init__(self, name: str):
        self.prefix = f"--{name}-data-path (not given)"
        self.document_lengths = np.zeros(0, dtype=np.int64)
        self.num_documents = self.num_tokens = 0


def build_datasets(data_path, seq_length: int, seed: int, weights, mock: bool = False,
                   vocab_size: int | None = None, split_paths: dict | None = None) -> dict:
    """{'train': dataset, 'valid': ..., 'test': ...}: a GPTDataset for one prefix (or mock data),
    a BlendedDataset of each prefix's split for several. With split_paths ({split: --data-path
    list or None}, Megatron's --train-data-path/--valid-data-path/--test-data-path) each split
    reads its own datasets whole and `weights` is not used."""
    out = {}
    if split_paths is not None and any(v is not None for v in split_paths.values()):
        for name in SPLITS:
            path = split_paths.get(name)
            corpora = open_corpora(path, seq_length, seed) if path is not None else [(None, _NoData(name))]
            out[name] = _split(corpora, name, lambda c: (0, c.num_documents), seq_length, seed)
        return out
    corpora = open_corpora(data_path, seq_length, seed, mock, vocab_size)
    for name in SPLITS:
        out[name] = _split(corpora, name, lambda c: split_documents(c.num_documents, weights)[name], seq_length,
                           seed)
    return out


def _split(corpora: list, name: str, documents, seq_length: int, seed: int):
    parts = [GPTDataset(c, documents(c), seq_length, seed, name, index=k) for k, (_, c) in enumerate(corpora)]
    if len(parts) == 1:
        return parts[0]
    given = [w for w, _ in corpora]
    mix = given if given[0] is not None else [float(c.num_tokens) for _, c in corpora]
    return BlendedDataset(parts, mix, name)
