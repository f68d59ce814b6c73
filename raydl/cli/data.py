"""raydl data prepare | inspect: make a raydl dataset from raw files, and look at one."""

from __future__ import annotations

import json
import logging

log = logging.getLogger(__name__)


def register(sub) -> None:
    p = sub.add_parser("data", help="Prepare or inspect datasets.", description=__doc__)
    cmds = p.add_subparsers(dest="data_command", required=True, metavar="SUBCOMMAND")

    prep = cmds.add_parser("prepare", help="Convert text, JSON lines, image folders or parquet into a raydl dataset "
                           "(streaming, bounded memory).")
    prep.add_argument("src", help="Input: a file, a directory (recursive, following symlinks) or a quoted glob such as "
                      "'corpus/*.txt'; a path that exists is taken as it is, even with '[' in its name.")
    prep.add_argument("--from", dest="kind", required=True, choices=("text", "jsonl", "images", "parquet"),
                      help="Input kind. images: one subfolder per class.")
    prep.add_argument("--out", required=True, help="Output dataset directory (must not exist or be empty).")
    prep.add_argument("--shard-rows", type=int, default=2048, help="Rows per parquet shard (default 2048).")
    prep.add_argument("--column", default="text", help="jsonl/parquet field holding the text (default: text).")
    prep.add_argument("--seq-len", type=int, default=128, help="Tokens per packed row for text (default 128).")
    prep.add_argument("--tokenizer", default="bytes", help="Text tokens: bytes (default, vocab 257), bpe (train a "
                      "byte-level BPE of --vocab-size on the input, saved as tokenizer.json in the dataset) or the "
                      "path of a Hugging Face tokenizer.json with an <|endoftext|> token.")
    prep.add_argument("--vocab-size", type=int, default=8192, help="Vocabulary of --tokenizer bpe (default 8192).")
    prep.add_argument("--keep-columns", action="store_true", help="parquet: a generic table, every column kept "
                      "as it is (a parquet table that is not tokens, images or a --column text column is one "
                      "anyway). Numeric scalars and lists reach the model as tensors; a variable-length list is "
                      "padded per batch with a <column>_mask.")
    prep.add_argument("--quiet", action="store_true", help="No progress line.")
    prep.set_defaults(func=run_prepare)

    ins = cmds.add_parser("inspect", help="Schema, rows, shards, size and a sample row of a dataset.")
    ins.add_argument("path", help="Dataset directory or URI.")
    ins.add_argument("--verify", action="store_true", help="Also check every shard's sha256 (reads all data; "
                     "training checks each shard when it first reads it).")
    ins.add_argument("--json", action="store_true", help="Print JSON instead of text.")
    ins.set_defaults(func=run_inspect)


def run_prepare(args) -> int:
    from raydl.data.prepare import prepare

    manifest = prepare(args.kind, args.src, args.out, shard_rows=args.shard_rows, column=args.column,
                       seq_len=args.seq_len, tokenizer=args.tokenizer, vocab_size=args.vocab_size,
                       keep_columns=args.keep_columns, progress=not args.quiet)
    splits = ", ".join(f"{k} {v['rows']:,} rows / {len(v['shards'])} shard(s)" for k, v in manifest["splits"].items())
    log.info(f"wrote {args.out}: {manifest['task']} data, {splits}")
    return 0


def run_inspect(args) -> int:
    from raydl.data.inspect import format_report, inspect

    report = inspect(args.path, verify=args.verify)
    print(json.dumps(report, indent=1, default=str) if args.json else format_report(report))
    return 0
