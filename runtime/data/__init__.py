"""Data: Megatron's indexed datasets (PREFIX.bin/.idx, read and written byte for byte), `specc
data prepare` (tokenize text into one), the tokenizers by Megatron's --tokenizer-type names, and
the training samples (seeded, split by documents, blended by weight, each data-parallel rank
reading only its own samples; or --mock-data)."""

from .dataset import (
    SPLITS,
    BlendedDataset,
    GPTDataset,
    MockDataset,
    build_datasets,
    open_corpora,
    open_dataset,
    parse_blend,
    split_documents,
)
from .errors import DataError
from .indexed import IndexedDataset, IndexedDatasetBuilder
from .prepare import expand_inputs, prepare, read_sidecar, stdlib_files
from .tokenizer import TOKENIZER_TYPES, ByteTokenizer, HuggingFaceTokenizer, build_tokenizer, vocab_size_with_padding

__all__ = [
    "SPLITS", "BlendedDataset", "GPTDataset", "MockDataset", "build_datasets", "open_corpora", "open_dataset",
    "parse_blend", "split_documents", "DataError", "IndexedDataset", "IndexedDatasetBuilder", "expand_inputs",
    "prepare", "read_sidecar", "stdlib_files", "TOKENIZER_TYPES", "ByteTokenizer", "HuggingFaceTokenizer",
    "build_tokenizer", "vocab_size_with_padding",
]
