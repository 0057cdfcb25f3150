"""Tokenizers for `specc data prepare`: the byte tokenizer (UTF-8 bytes, vocabulary 256, needs
nothing) and a Hugging Face tokenizer.json (through the `tokenizers` package, when installed)."""

from __future__ import annotations

import hashlib
import json
import os

from .errors import DataError


class ByteTokenizer:
    """Token = one byte of the UTF-8 encoding. Vocabulary 256, no special tokens."""

    name = "byte"
    vocab_size = 256

    def encode(self, text: str) -> bytes:
        return text.encode("utf-8")

    def decode(self, ids) -> str:
        return bytes(int(i) for i in ids).decode("utf-8", errors="replace")

    def describe(self) -> dict:
        return {"type": "byte", "vocab_size": self.vocab_size}


class JsonTokenizer:
    """A Hugging Face tokenizer.json, loaded with the `tokenizers` package."""

    def __init__(self, path: str):
        if not os.path.isfile(path):
            raise DataError(f"--tokenizer {path}: no such file (use 'byte' or the path of a tokenizer.json)")
        try:
            with open(path, "rb") as f:
                raw = f.read()
            json.loads(raw.decode("utf-8"))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
            raise DataError(f"--tokenizer {path}: not a readable JSON tokenizer file ({_short(e)})") from None
        try:
            from tokenizers import Tokenizer
        except ImportError:
            raise DataError(f"--tokenizer {path}: reading a tokenizer.json needs the 'tokenizers' package "
                            "(pip install tokenizers); '--tokenizer byte' needs nothing") from None
        try:
            self._tok = Tokenizer.from_str(raw.decode("utf-8"))
        except Exception as e:  # the library raises its own exception types for bad files
            raise DataError(f"--tokenizer {path}: not a valid tokenizer.json ({_short(e)})") from None
        self.path = path
        self.sha256 = hashlib.sha256(raw).hexdigest()
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        self.name = os.path.basename(path)

    def encode(self, text: str) -> list:
        return self._tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids) -> str:
        return self._tok.decode([int(i) for i in ids])

    def describe(self) -> dict:
        return {"type": "tokenizer.json", "path": os.path.abspath(self.path), "sha256": self.sha256,
                "vocab_size": self.vocab_size}


def build_tokenizer(spec: str):
    if spec == "byte":
        return ByteTokenizer()
    return JsonTokenizer(spec)


def _short(e: Exception) -> str:
    text = str(e).splitlines()[0] if str(e) else type(e).__name__
    return text[:200]
