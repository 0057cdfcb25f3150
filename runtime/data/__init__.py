"""Data: `specc data prepare` (tokenize text into a memory-mapped token file with a document
index) and the training samples (seeded fixed-length windows, split into train and valid,
each data-parallel rank reading only its own samples)."""

from .dataset import TokenWindows, build_datasets, split_ranges
from .errors import DataError
from .indexed import IndexedTokens
from .prepare import expand_inputs, prepare, stdlib_files
from .tokenizer import ByteTokenizer, JsonTokenizer, build_tokenizer

__all__ = [
    "DataError", "IndexedTokens", "TokenWindows", "build_datasets", "split_ranges", "prepare", "expand_inputs",
    "stdlib_files", "ByteTokenizer", "JsonTokenizer", "build_tokenizer",
]
