"""`specc data prepare`: tokenize text files into a memory-mapped token file with a document
index (Megatron's preprocess_data). Imports the runtime only when it runs."""

from __future__ import annotations

import sys


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
        prepare(files, args.tokenizer, args.output, token_dtype=args.token_dtype, json_key=args.json_key,
                log=lambda m: print(m, file=sys.stderr))
    except DataError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


def add_parsers(sub) -> None:
    c = sub.add_parser("data", help="prepare training data (tokenize text into a memory-mapped token file)")
    dsub = c.add_subparsers(dest="data_command", metavar="SUBCOMMAND")
    dsub.required = True
    p = dsub.add_parser("prepare", help="tokenize text files into DIR/tokens.bin, documents.npy, dataset.json",
                        description="Each text file is one document; each line of a .jsonl file is one document "
                        "(its --json-key field). Files are read in sorted order.")
    p.add_argument("--input", dest="inputs", action="append", default=[], metavar="GLOB",
                   help="files to read (quote the glob; ** recurses); repeatable")
    p.add_argument("--stdlib", action="store_true",
                   help="add the Python standard library's top-level sources (the embedded corpus)")
    p.add_argument("--tokenizer", default="byte", metavar="byte|PATH",
                   help="'byte' (UTF-8 bytes, vocabulary 256) or a Hugging Face tokenizer.json (default byte)")
    p.add_argument("--output", required=True, metavar="DIR")
    p.add_argument("--token-dtype", default="auto", choices=("auto", "uint8", "uint16", "int32"),
                   help="dtype of the token file (default: the smallest that holds the vocabulary)")
    p.add_argument("--json-key", default="text", help="the text field of .jsonl records (default text)")
    p.add_argument("--max-files", type=int, default=None, metavar="N", help="read only the first N files (sorted)")
    p.set_defaults(func=cmd_prepare)
