"""Tokenizers by Megatron's `--tokenizer-type` names, each through the field's library:

    ByteTokenizer              UTF-8 bytes, vocabulary 256, no end-of-document id (needs nothing)
    GPT2BPETokenizer           --vocab-file vocab.json --merge-file merges.txt (GPT-2's byte-level BPE,
                               through `tokenizers`); EOD <|endoftext|>
    HuggingFaceTokenizer       --tokenizer-model: a tokenizer.json, or a folder holding one (`tokenizers`);
                               EOD: the folder's tokenizer_config.json eos_token, if any
    SentencePieceTokenizer     --tokenizer-model m.model (`sentencepiece`), with Megatron's special tokens
                               (<CLS> <SEP> <EOD> <MASK>, pad, bos, eos) added after the model's pieces
    GPTSentencePieceTokenizer  --tokenizer-model m.model, the model's pieces only; EOD = its eos
    Llama2Tokenizer            --tokenizer-model m.model, the model's pieces only; EOD = its eos; a text
                               encodes with the model's bos id first (Megatron's _Llama2Tokenizer)
    TikTokenizer               --tokenizer-model: a tiktoken rank file (base64 token, rank per line) or
                               Megatron's JSON rank list (`tiktoken`), --tiktoken-pattern v1|v2,
                               --tiktoken-num-special-tokens (1000) ids before the ranks, --vocab-size (2**17)
    NullTokenizer              --vocab-size N: the text is the ids, space separated; EOD = N

Each has `vocab_size`, `eod` (None where there is none), `encode(text)` (no special tokens added),
`decode(ids)` and `describe()` (what was used, with the files' sha256). Megatron pads the model's
vocabulary, not the tokenizer's: `vocab_size_with_padding`.
"""

from __future__ import annotations

import base64
import hashlib
import json
import math
import os

from .errors import DataError

TOKENIZER_TYPES = ("ByteTokenizer", "GPT2BPETokenizer", "HuggingFaceTokenizer", "SentencePieceTokenizer",
                   "GPTSentencePieceTokenizer", "Llama2Tokenizer", "TikTokenizer", "NullTokenizer")

# tiktoken split patterns of Megatron's TikTokenizer (megatron/training/tokenizer/tokenizer.py)
PATTERN_TIKTOKEN = r"[^\r\n\p{L}\p{N}]?+\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]++[\r\n]*|\s*[\r\n]|\s+(?!\S)|\s+"
PATTERN_TIKTOKEN_V2 = (r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+|"
                       r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*|\p{N}|"
                       r" ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
TIKTOKEN_SPECIAL_TOKENS = ["<unk>", "<s>", "</s>"]


def vocab_size_with_padding(vocab_size: int, divisible_by: int, tensor_parallel_size: int = 1) -> int:
    """Megatron's _vocab_size_with_padding: the model's vocabulary, the tokenizer's rounded up to
    a multiple of make_vocab_size_divisible_by x TP (so every TP rank holds an equal slice)."""
    multiple = divisible_by * tensor_parallel_size
    return int(math.ceil(vocab_size / multiple) * multiple)


def _sha256(path: str) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _short(e: BaseException) -> str:
    text = str(e).splitlines()[0] if str(e) else type(e).__name__
    return text[:200]


def _file(flag: str, path, what: str) -> str:
    if path is None:
        raise DataError(f"{flag} is needed: {what}")
    if not os.path.isfile(path):
        raise DataError(f"{flag} {path}: no such file ({what})")
    return path


def _library(name: str, flag_what: str):
    try:
        return __import__(name)
    except ImportError:
        raise DataError(f"{flag_what} needs the '{name}' package (pip install {name})") from None


class ByteTokenizer:
    """Token = one byte of the UTF-8 encoding. Vocabulary 256: every id is a byte, so there is no
    id left for an end-of-document token."""

    name = "ByteTokenizer"
    vocab_size = 256
    eod = None
    linear_time = True  # str.encode: tokenized in the process, no time limit needed (encode.py)

    def encode(self, text: str) -> bytes:
        return text.encode("utf-8")

    def decode(self, ids) -> str:
        return bytes(int(i) for i in ids).decode("utf-8", errors="replace")

    def describe(self) -> dict:
        return {"type": "byte", "vocab_size": self.vocab_size}


class _TokenizersTokenizer:
    """A `tokenizers.Tokenizer`, no special tokens added when encoding."""

    name = ""
    patterns: tuple = ()  # the regular expressions its file gives (named when tokenizing runs too long)

    def encode(self, text: str) -> list:
        return self._tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=False)


class GPT2BPETokenizer(_TokenizersTokenizer):
    """GPT-2's byte-level BPE from vocab.json + merges.txt. As Megatron's _GPT2BPETokenizer:
    vocabulary = the entries of vocab.json, EOD = <|endoftext|>'s id, and no text is read as a
    special token (an "<|endoftext|>" in a document is encoded as its characters)."""

    name = "GPT2BPETokenizer"

    def __init__(self, vocab_file, merge_file):
        _file("--vocab-file", vocab_file, "GPT2BPETokenizer reads GPT-2's vocab.json")
        _file("--merge-file", merge_file, "GPT2BPETokenizer reads GPT-2's merges.txt")
        try:
            with open(vocab_file, encoding="utf-8") as f:
                vocab = json.load(f)
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
            raise DataError(f"--vocab-file {vocab_file}: not a readable JSON vocabulary ({_short(e)})") from None
        if not isinstance(vocab, dict) or not all(isinstance(v, int) for v in vocab.values()):
            raise DataError(f"--vocab-file {vocab_file}: not a JSON object of token -> id")
        if "<|endoftext|>" not in vocab:
            raise DataError(f"--vocab-file {vocab_file}: no <|endoftext|> entry (GPT-2's end-of-document token)")
        _library("tokenizers", "--tokenizer-type GPT2BPETokenizer")
        from tokenizers import Tokenizer, decoders, models, pre_tokenizers

        try:
            bpe = models.BPE.from_file(vocab_file, merge_file)
        except Exception as e:  # the library's own exception types
            raise DataError(f"--merge-file {merge_file}: not GPT-2 merges for {vocab_file} ({_short(e)})") from None
        self._tok = Tokenizer(bpe)
        self._tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        self._tok.decoder = decoders.ByteLevel()
        self.vocab_size = len(vocab)
        self.eod = int(vocab["<|endoftext|>"])
        self.files = {"vocab_file": vocab_file, "merge_file": merge_file}

    def describe(self) -> dict:
        return _describe(self, self.files)


class HuggingFaceTokenizer(_TokenizersTokenizer):
    """A Hugging Face tokenizer.json (a file, or a folder holding one), through `tokenizers`;
    vocabulary with the added tokens (Megatron's len(tokenizer)); EOD: the eos_token of the
    folder's tokenizer_config.json, when it has one."""

    name = "HuggingFaceTokenizer"

    def __init__(self, tokenizer_model, flag: str = "--tokenizer-model"):
        if tokenizer_model is None:
            raise DataError(f"{flag} is needed: HuggingFaceTokenizer reads a tokenizer.json or a folder holding one")
        folder = tokenizer_model if os.path.isdir(tokenizer_model) else os.path.dirname(tokenizer_model)
        path = os.path.join(tokenizer_model, "tokenizer.json") if os.path.isdir(tokenizer_model) else tokenizer_model
        if not os.path.isfile(path):
            raise DataError(f"{flag} {tokenizer_model}: no such file (a tokenizer.json, or a folder holding one; "
                            "specc reads local files only)")
        try:
            with open(path, "rb") as f:
                raw = f.read()
            config = json.loads(raw.decode("utf-8"))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError, RecursionError, ValueError) as e:
            raise DataError(f"{flag} {path}: not a readable JSON tokenizer file ({_short(e)})") from None
        _library("tokenizers", f"{flag} {path}: reading a tokenizer.json")
        from tokenizers import Tokenizer

        try:
            self._tok = Tokenizer.from_str(raw.decode("utf-8"))
        except Exception as e:  # the library raises its own exception types for bad files
            raise DataError(f"{flag} {path}: not a valid tokenizer.json ({_short(e)})") from None
        self.path = path
        self.patterns = _regex_patterns(config)
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        self.eod = None
        self.files = {"tokenizer_model": path}
        config = os.path.join(folder, "tokenizer_config.json")
        if os.path.isfile(config):
            try:
                with open(config, encoding="utf-8") as f:
                    eos = json.load(f).get("eos_token")
            except (OSError, UnicodeDecodeError, json.JSONDecodeError, AttributeError) as e:
                raise DataError(f"{config}: not a readable tokenizer config ({_short(e)})") from None
            eos = eos.get("content") if isinstance(eos, dict) else eos
            if isinstance(eos, str):
                eod = self._tok.token_to_id(eos)
                if eod is None:
                    raise DataError(f"{config}: its eos_token {eos!r} is not in {path}")
                self.eod = int(eod)
                self.files["tokenizer_config"] = config

    def describe(self) -> dict:
        return _describe(self, self.files)


class SentencePieceTokenizer:
    """Megatron's _SentencePieceTokenizer: the model's pieces, then <CLS>, <SEP>, <EOD>, <MASK>
    and the pad/bos/eos pieces (<PAD>/<BOS>/<EOS> where the model has none) added as new ids
    when not already pieces; those strings in a text encode as their ids; EOD = <EOD>."""

    name = "SentencePieceTokenizer"

    def __init__(self, tokenizer_model, gpt: bool = False, kind: str | None = None):
        kind = kind or ("GPTSentencePieceTokenizer" if gpt else "SentencePieceTokenizer")
        _file("--tokenizer-model", tokenizer_model, f"{kind} reads a SentencePiece .model file")
        spm = _library("sentencepiece", f"--tokenizer-type {kind}")
        try:
            self._sp = spm.SentencePieceProcessor(model_file=tokenizer_model)
        except Exception as e:  # OSError or RuntimeError from the library
            raise DataError(f"--tokenizer-model {tokenizer_model}: not a SentencePiece model ({_short(e)})") from None
        self.name = kind
        self.files = {"tokenizer_model": tokenizer_model}
        self._vocab = {self._sp.id_to_piece(i): i for i in range(len(self._sp))}
        self._special: dict = {}
        if gpt:  # Megatron's _GPTSentencePieceTokenizer: the pieces only
            self.eod = int(self._sp.eos_id()) if self._sp.eos_id() >= 0 else None
        else:
            for token in ("<CLS>", "<SEP>", "<EOD>", "<MASK>"):
                self._add_special(token)
            for get, fallback in ((self._sp.pad_id, "<PAD>"), (self._sp.bos_id, "<BOS>"), (self._sp.eos_id, "<EOS>")):
                i = get()
                self._add_special(self._sp.id_to_piece(i) if 0 <= i < len(self._sp) else fallback)
            self.eod = self._vocab["<EOD>"]
        self.vocab_size = len(self._vocab)
        self._bos = []  # Llama2Tokenizer: its texts start with the model's bos id
        if kind == "Llama2Tokenizer" and self._sp.bos_id() >= 0:
            self._bos = [int(self._sp.bos_id())]

    def _add_special(self, token: str) -> None:
        if token not in self._vocab:
            self._vocab[token] = len(self._vocab)
        self._special[token] = self._vocab[token]

    def encode(self, text: str) -> list:
        if not self._special:
            return self._bos + list(self._sp.encode_as_ids(text))
        ids, i = [], 0
        while True:  # the earliest special token's text, then the next (Megatron's tokenize)
            found = {t: text.find(t, i) for t in self._special}
            found = {t: at for t, at in found.items() if at >= 0}
            if not found:
                break
            token = min(found, key=lambda t: (found[t], list(self._special).index(t)))
            ids.extend(self._sp.encode_as_ids(text[i:found[token]]))
            ids.append(self._special[token])
            i = found[token] + len(token)
        ids.extend(self._sp.encode_as_ids(text[i:]))
        return ids

    def decode(self, ids) -> str:
        inverse = {v: k for k, v in self._special.items()}
        out, run = [], []
        for i in (int(x) for x in ids):
            if i in inverse:
                out.append(self._sp.decode_ids(run))
                out.append(inverse[i])
                run = []
            else:
                run.append(i)
        out.append(self._sp.decode_ids(run))
        return "".join(out)

    def describe(self) -> dict:
        return _describe(self, self.files)


class TikTokenizer:
    """Megatron's TikTokenizer (CustomTikTokenizer) through `tiktoken`: ids 0 .. N-1 are special
    tokens (<unk>, <s>, </s>, then <SPECIAL_3> ...; N = --tiktoken-num-special-tokens), the BPE
    ranks follow from id N, up to --vocab-size ids in all; EOD = </s>. The rank file is tiktoken's
    (`base64-token rank` per line, read by tiktoken.load.load_tiktoken_bpe) or Megatron's JSON list
    of {rank, token_bytes, token_str}."""

    name = "TikTokenizer"

    def __init__(self, tokenizer_model, tiktoken_pattern, vocab_size=None, num_special_tokens=1000):
        _file("--tokenizer-model", tokenizer_model, "TikTokenizer reads a tiktoken rank file")
        if tiktoken_pattern not in ("v1", "v2"):
            raise DataError(f"--tiktoken-pattern must be v1 or v2 for --tokenizer-type TikTokenizer, got "
                            f"{tiktoken_pattern!r}")
        tiktoken = _library("tiktoken", "--tokenizer-type TikTokenizer")
        self.vocab_size = 2 ** 17 if vocab_size is None else int(vocab_size)
        if num_special_tokens < len(TIKTOKEN_SPECIAL_TOKENS):
            raise DataError(f"--tiktoken-num-special-tokens {num_special_tokens}: must be at least "
                            f"{len(TIKTOKEN_SPECIAL_TOKENS)} ({', '.join(TIKTOKEN_SPECIAL_TOKENS)})")
        if self.vocab_size <= num_special_tokens:
            raise DataError(f"--vocab-size {self.vocab_size}: TikTokenizer's {num_special_tokens} special tokens "
                            f"(--tiktoken-num-special-tokens) take ids 0..{num_special_tokens - 1}, so the vocabulary "
                            f"must be larger than {num_special_tokens}, with room for the ranks of every single byte "
                            f"after them")
        full = _tiktoken_ranks(tokenizer_model)
        inner = self.vocab_size - num_special_tokens
        if len(full) < inner:
            raise DataError(f"--tokenizer-model {tokenizer_model}: {len(full)} ranks, but --vocab-size "
                            f"{self.vocab_size} with {num_special_tokens} special tokens needs {inner}")
        ranks = {token: rank + num_special_tokens for token, rank in full.items() if rank < inner}
        # tiktoken's byte-level BPE panics (a Rust panic, not an error) on a byte without a rank
        byte_ranks = {b: full.get(bytes([b])) for b in range(256)}
        absent = [b for b, r in byte_ranks.items() if r is None]
        if absent:
            raise DataError(f"--tokenizer-model {tokenizer_model}: no rank for the single byte 0x{absent[0]:02x} "
                            f"({len(absent)} of the 256 bytes have none); byte-level BPE needs every byte")
        cut = [b for b, r in byte_ranks.items() if r >= inner]
        if cut:
            raise DataError(f"--vocab-size {self.vocab_size}: with {num_special_tokens} special tokens it keeps ranks "
                            f"0..{inner - 1} of {tokenizer_model}, which leave out the single byte 0x{cut[0]:02x} "
                            f"(rank {byte_ranks[cut[0]]}); byte-level BPE needs every byte: give --vocab-size at least "
                            f"{num_special_tokens + max(byte_ranks.values()) + 1}")
        specials = TIKTOKEN_SPECIAL_TOKENS + [f"<SPECIAL_{i}>" for i in range(len(TIKTOKEN_SPECIAL_TOKENS),
                                                                              num_special_tokens)]
        pattern = PATTERN_TIKTOKEN if tiktoken_pattern == "v1" else PATTERN_TIKTOKEN_V2
        try:
            self._enc = tiktoken.Encoding(name=os.path.basename(tokenizer_model), pat_str=pattern,
                                          mergeable_ranks=ranks,
                                          special_tokens={t: i for i, t in enumerate(specials)})
        except Exception as e:  # tiktoken's own errors for inconsistent ranks
            raise DataError(f"--tokenizer-model {tokenizer_model}: tiktoken refuses these ranks ({_short(e)})") from None
        self.eod = specials.index("</s>")
        self.patterns = (pattern,)
        self.files = {"tokenizer_model": tokenizer_model}
        self.settings = {"tiktoken_pattern": tiktoken_pattern, "num_special_tokens": num_special_tokens}

    def encode(self, text: str) -> list:
        return self._enc.encode_ordinary(text)

    def decode(self, ids) -> str:
        return self._enc.decode([int(i) for i in ids])

    def describe(self) -> dict:
        return {**_describe(self, self.files), **self.settings}


def _regex_patterns(config) -> tuple:
    """The regular expressions of a tokenizer.json, in file order, each once: every `{"Regex": ...}`
    (Split pre-tokenizers, Replace normalizers and decoders, at any depth of a Sequence)."""
    found, stack = [], [config]
    while stack:  # by hand: the file's nesting is not bounded by Python's recursion limit
        node = stack.pop()
        if isinstance(node, dict):
            if isinstance(node.get("Regex"), str) and node["Regex"] not in found:
                found.append(node["Regex"])
            stack.extend(reversed(list(node.values())))
        elif isinstance(node, list):
            stack.extend(reversed(node))
    return tuple(found)


def _tiktoken_ranks(path: str) -> dict:
    """{token bytes: rank} from a tiktoken rank file or Megatron's JSON rank list, ranks 0..n-1."""
    try:
        with open(path, "rb") as f:
            raw = f.read()
    except OSError as e:
        raise DataError(f"--tokenizer-model {path}: cannot read ({e.strerror or e})") from None
    if path.endswith(".json"):
        try:
            entries = json.loads(raw.decode("utf-8"))
            ranks = {base64.b64decode(e["token_bytes"]): int(e["rank"]) for e in entries}
        except (UnicodeDecodeError, json.JSONDecodeError, TypeError, KeyError, ValueError) as e:
            raise DataError(f"--tokenizer-model {path}: not Megatron's JSON rank list of {{rank, token_bytes, "
                            f"token_str}} ({_short(e)})") from None
    else:
        from tiktoken.load import load_tiktoken_bpe

        try:  # the hash: tiktoken caches files by path, and a changed file must not read as its old copy
            ranks = load_tiktoken_bpe(path, expected_hash=hashlib.sha256(raw).hexdigest())
        except Exception as e:  # binascii.Error, ValueError
            raise DataError(f"--tokenizer-model {path}: not a tiktoken rank file ('base64-token rank' per line) "
                            f"({_short(e)})") from None
    if sorted(ranks.values()) != list(range(len(ranks))):
        raise DataError(f"--tokenizer-model {path}: its ranks are not 0 .. {len(ranks) - 1}, each once")
    return ranks


class NullTokenizer:
    """Megatron's _NullTokenizer: the text is the token ids, separated by spaces; vocabulary
    --vocab-size + 1, the last id the end of document."""

    name = "NullTokenizer"
    linear_time = True  # split and int(): tokenized in the process, no time limit needed (encode.py)

    def __init__(self, vocab_size):
        if vocab_size is None or vocab_size < 1:
            raise DataError(f"--tokenizer-type NullTokenizer needs --vocab-size N (at least 1), got {vocab_size}")
        self.vocab_size = int(vocab_size) + 1
        self.eod = int(vocab_size)

    def encode(self, text: str) -> list:
        try:
            return [int(x) for x in text.split()]
        except ValueError:
            pass
        for x in text.split():  # the error path only: which word, and why
            try:
                int(x)
            except ValueError:
                digits = x.lstrip("+-").replace("_", "")
                if digits.isdigit():  # Python converts at most sys.get_int_max_str_digits() digits
                    raise DataError(f"NullTokenizer: token id {x[:20]}... ({len(digits)} digits) is far too large "
                                    "for any vocabulary") from None
                shown = x if len(x) <= 40 else x[:40] + "..."
                raise DataError(f"NullTokenizer reads space-separated token ids; the text holds {shown!r}") from None
        raise DataError("NullTokenizer reads space-separated token ids; the text holds something else")

    def decode(self, ids) -> str:
        return " ".join(str(int(i)) for i in ids)

    def describe(self) -> dict:
        return {"type": self.name, "vocab_size": self.vocab_size}


def _describe(tok, files: dict) -> dict:
    return {"type": tok.name, "vocab_size": tok.vocab_size, "eod": tok.eod,
            **{k: os.path.abspath(v) for k, v in files.items()},
            "sha256": {k: _sha256(v) for k, v in files.items()}}


def build_tokenizer(tokenizer_type: str = "ByteTokenizer", *, vocab_file=None, merge_file=None, tokenizer_model=None,
                    vocab_size=None, tiktoken_pattern=None, tiktoken_num_special_tokens: int = 1000):
    """A tokenizer by Megatron's --tokenizer-type name (and specc's shorthands: 'byte', or the
    path of a tokenizer.json)."""
    if tokenizer_type in ("byte", "ByteTokenizer"):
        return ByteTokenizer()
    if tokenizer_type == "GPT2BPETokenizer":
        return GPT2BPETokenizer(vocab_file, merge_file)
    if tokenizer_type == "HuggingFaceTokenizer":
        return HuggingFaceTokenizer(tokenizer_model)
    if tokenizer_type in ("SentencePieceTokenizer", "GPTSentencePieceTokenizer", "Llama2Tokenizer"):
        return SentencePieceTokenizer(tokenizer_model, gpt=tokenizer_type != "SentencePieceTokenizer",
                                      kind=tokenizer_type)
    if tokenizer_type == "TikTokenizer":
        return TikTokenizer(tokenizer_model, tiktoken_pattern, vocab_size, tiktoken_num_special_tokens)
    if tokenizer_type == "NullTokenizer":
        return NullTokenizer(vocab_size)
    if tokenizer_type.endswith(".json") or os.path.isdir(tokenizer_type) or os.path.isfile(tokenizer_type):
        return HuggingFaceTokenizer(tokenizer_type, flag="--tokenizer")
    raise DataError(f"--tokenizer-type {tokenizer_type}: unknown (known: {', '.join(TOKENIZER_TYPES)})")


# The name used before the Megatron types: a Hugging Face tokenizer.json.
JsonTokenizer = HuggingFaceTokenizer
