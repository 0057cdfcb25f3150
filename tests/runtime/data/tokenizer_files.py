"""Tiny tokenizer files in the published formats, written by the tests (nothing is downloaded):
GPT-2's vocab.json + merges.txt, a tiktoken rank file and Megatron's JSON rank list with the same
ranks, and a SentencePiece model trained on the spot."""

from __future__ import annotations

import base64
import json
import os

# Merges in rank order; the merged token of merge k gets id 256 + k, so the byte-level BPE ranks
# are the ids (what tiktoken needs to be the independent reference of GPT-2's BPE).
MERGES = [("h", "e"), ("t", "he"), (" ", "the"), ("i", "n"), (" ", "in"), ("o", "n"), ("e", "r"), (" ", "c")]
GPT2_VOCAB_SIZE = 256 + len(MERGES) + 1  # the bytes, the merges, <|endoftext|>
GPT2_PATTERN = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""


def bytes_to_unicode() -> dict:
    """GPT-2's byte -> printable character map (vocab.json and merges.txt spell bytes with it)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, (chr(c) for c in cs)))


def ranks() -> dict:
    """{token bytes: rank}: the 256 bytes, then the merges."""
    out = {bytes([b]): b for b in range(256)}
    for k, (a, b) in enumerate(MERGES):
        out[(a + b).encode()] = 256 + k
    return out


def gpt2_files(directory) -> tuple[str, str]:
    b2u = bytes_to_unicode()

    def spell(text: str) -> str:
        return "".join(b2u[b] for b in text.encode())

    vocab = {b2u[tok[0]] if len(tok) == 1 else spell(tok.decode()): rank for tok, rank in ranks().items()}
    vocab["<|endoftext|>"] = len(vocab)
    vocab_file, merge_file = os.path.join(directory, "vocab.json"), os.path.join(directory, "merges.txt")
    with open(vocab_file, "w", encoding="utf-8") as f:
        json.dump(vocab, f, ensure_ascii=False)
    with open(merge_file, "w", encoding="utf-8") as f:
        f.write("#version: 0.2\n" + "".join(f"{spell(a)} {spell(b)}\n" for a, b in MERGES))
    return vocab_file, merge_file


def tiktoken_files(directory) -> tuple[str, str]:
    """The same ranks as a tiktoken rank file and as Megatron's JSON rank list."""
    plain, megatron = os.path.join(directory, "tiny.tiktoken"), os.path.join(directory, "tiny.json")
    with open(plain, "wb") as f:
        for tok, rank in sorted(ranks().items(), key=lambda kv: kv[1]):
            f.write(base64.b64encode(tok) + b" " + str(rank).encode() + b"\n")
    with open(megatron, "w", encoding="utf-8") as f:
        json.dump([{"rank": rank, "token_bytes": base64.b64encode(tok).decode(), "token_str": tok.decode("latin-1")}
                   for tok, rank in sorted(ranks().items(), key=lambda kv: kv[1])], f)
    return plain, megatron


def sentencepiece_model(directory, vocab_size: int = 40) -> str:
    import sentencepiece as spm

    text = ["the cat sat on the mat", "a hen in the pen", "then the other cat ran", "in an inn at ten"] * 20
    prefix = os.path.join(directory, "sp")
    spm.SentencePieceTrainer.train(sentence_iterator=iter(text), model_prefix=prefix, vocab_size=vocab_size,
                                   model_type="bpe", minloglevel=2, num_threads=1)
    return prefix + ".model"
