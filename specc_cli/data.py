"""`specc data prepare`: tokenize text files into Megatron's indexed dataset, PREFIX.bin and
PREFIX.idx (Megatron's tools/preprocess_data.py), with Megatron's tokenizer flags. Imports the
runtime only when it runs."""

from __future__ import annotations

import sys

TOKENIZER_TYPES = ("ByteTokenizer", "GPT2BPETokenizer", "HuggingFaceTokenizer", "SentencePieceTokenizer",
                   "GPTSentencePieceTokenizer", "Llama2Tokenizer", "TikTokenizer", "NullTokenizer")  # runtime.data.TOKENIZER_TYPES


def add_tokenizer_arguments(g) -> None:
    """Megatron's tokenizer flags (shared by `specc data prepare` and `specc train`)."""
    g.add_argument("--tokenizer-type", default=None, choices=TOKENIZER_TYPES, metavar="TYPE",
                   help="Megatron's tokenizer names: " + ", ".join(TOKENIZER_TYPES))
    g.add_argument("--vocab-file", default=None, metavar="PATH", help="GPT2BPETokenizer: GPT-2's vocab.json")
    g.add_argument("--merge-file", default=None, metavar="PATH", help="GPT2BPETokenizer: GPT-2's merges.txt")
    g.add_argument("--tokenizer-model", default=None, metavar="PATH",
                   help="HuggingFaceTokenizer: a tokenizer.json or its folder; SentencePieceTokenizer, GPTSentencePieceTokenizer, Llama2Tokenizer: a .model; "
                   "TikTokenizer: a tiktoken rank file or Megatron's JSON rank list")
    g.add_argument("--vocab-size", type=int, default=None, metavar="N",
                   help="NullTokenizer: ids below N (EOD = N); TikTokenizer: its vocabulary (default 131072)")
    g.add_argument("--tiktoken-pattern", default=None, choices=("v1", "v2"), help="TikTokenizer's split pattern")
    g.add_argument("--tiktoken-num-special-tokens", type=int, default=1000, metavar="N",
                   help="TikTokenizer: special-token ids before the ranks (default 1000)")


def tokenizer_from_args(args):
    from runtime.data import DataError, build_tokenizer

    given = getattr(args, "tokenizer", None)
    if given is not None and args.tokenizer_type is not None:
        raise DataError(f"--tokenizer {given} and --tokenizer-type {args.tokenizer_type}: give one")
    return build_tokenizer(args.tokenizer_type or given or "ByteTokenizer", vocab_file=args.vocab_file,
                           merge_file=args.merge_file, tokenizer_model=args.tokenizer_model,
                           vocab_size=args.vocab_size, tiktoken_pattern=args.tiktoken_pattern,
                           tiktoken_num_special_tokens=args.tiktoken_num_special_tokens)


def cmd_prepare(args) -> int:
    from runtime.data import DataError, expand_inputs, prepare, stdlib_files

    try:
        if not args.inputs and not args.stdlib:
            raise DataError("give --input 'GLOB' (repeatable) or --stdlib")
        files = expand_inputs(args.inputs) if args.inputs else []
        if args.stdlib:
            files = sorted(set(files) | set(stdlib_files()))
        if args.max_files is not None:
            if args.max_files < 1:
                raise DataError(f"--max-files must be at least 1, got {args.max_files}")
            files = files[:args.max_files]
        tok = tokenizer_from_args(args)
        prepare(files, tok, args.output_prefix, token_dtype=args.token_dtype, json_key=args.json_key,
                append_eod=args.append_eod, log=lambda m: print(m, file=sys.stderr),
                **({} if args.tokenize_time_limit is None else {"time_limit": args.tokenize_time_limit}))
    except DataError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


def add_parsers(sub) -> None:
    c = sub.add_parser("data", help="prepare training data (tokenize text into a Megatron indexed dataset)")
    dsub = c.add_subparsers(dest="data_command", metavar="SUBCOMMAND")
    dsub.required = True
    p = dsub.add_parser("prepare", help="tokenize text files into PREFIX.bin and PREFIX.idx (Megatron's format)",
                        description="Each text file is one document; each line of a .jsonl file is one document "
                        "(its --json-keys field). Files are read in sorted order. Writes Megatron's indexed dataset "
                        "PREFIX.bin + PREFIX.idx (what Megatron's preprocess_data writes; --data-path PREFIX reads "
                        "it, here and in Megatron) and PREFIX.specc.json (what was used).")
    p.add_argument("--input", dest="inputs", action="append", default=[], metavar="GLOB",
                   help="files to read (quote the glob; ** recurses); repeatable")
    p.add_argument("--stdlib", action="store_true",
                   help="add the Python standard library's top-level sources (the embedded corpus)")
    p.add_argument("--output-prefix", "--output", dest="output_prefix", required=True, metavar="PREFIX",
                   help="write PREFIX.bin, PREFIX.idx (and PREFIX.specc.json)")
    g = p.add_argument_group("tokenizer (default: ByteTokenizer)")
    g.add_argument("--tokenizer", default=None, metavar="byte|PATH",
                   help="shorthand: 'byte' (UTF-8 bytes, vocabulary 256) or a Hugging Face tokenizer.json")
    add_tokenizer_arguments(g)
    p.add_argument("--append-eod", dest="append_eod", action="store_true", default=True,
                   help="append the tokenizer's end-of-document id to each document (the default)")
    p.add_argument("--no-append-eod", dest="append_eod", action="store_false")
    p.add_argument("--token-dtype", default="auto", choices=("auto", "uint8", "uint16", "int32", "int64"),
                   help="dtype of PREFIX.bin (default: Megatron's choice, uint16 below 65500 ids, else int32)")
    p.add_argument("--json-keys", "--json-key", dest="json_key", default="text", metavar="KEY",
                   help="the text field of .jsonl records (default text)")
    p.add_argument("--max-files", type=int, default=None, metavar="N", help="read only the first N files (sorted)")
    p.add_argument("--tokenize-time-limit", type=float, default=None, metavar="SECONDS",
                   help="the tokenizer may take SECONDS plus 1 s per 10,000 characters read so far, else the run "
                   "stops with the document and the tokenizer's patterns named: a split pattern that backtracks "
                   "catastrophically never hangs (default 10: runtime.data.encode.DEFAULT_SECONDS)")
    p.set_defaults(func=cmd_prepare)
