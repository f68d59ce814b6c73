"""raydl data prepare | inspect: make a raydl dataset from raw files, and look at one."""

from __future__ import annotations

import argparse
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
    prep.add_argument("--column", default="text", help="jsonl/parquet field holding the text (default: text; also --format text's).")
    prep.add_argument("--seq-len", type=int, default=128, help="Tokens per packed row for text (default 128); with --format, the longest row (--overflow).")
    prep.add_argument("--tokenizer", default="bytes", help="Text tokens: bytes (default, vocab 257), bpe (train a "
                      "byte-level BPE of --vocab-size on the input, saved as tokenizer.json in the dataset) or the "
                      "path of a Hugging Face tokenizer.json with an <|endoftext|> token. With --format: a local Hugging Face "
                      "tokenizer directory (tokenizer.json + tokenizer_config.json; its chat template for chat).")
    prep.add_argument("--vocab-size", type=int, default=8192, help="Vocabulary of --tokenizer bpe (default 8192).")
    prep.add_argument("--format", choices=("text", "prompt-response", "chat"), help="jsonl records for "
                      "fine-tuning, one row each with its loss mask (docs/finetune.md): text (all tokens learnt), "
                      "prompt-response (the response learnt) or chat (the assistant turns learnt, rendered with the "
                      "tokenizer's chat template). Needs --tokenizer DIR, a local Hugging Face tokenizer directory "
                      "(tokenizer.json + tokenizer_config.json).")
    prep.add_argument("--train-on", default="assistant", choices=("last", "assistant", "all"), help="chat: which "
                      "tokens are learnt: the last assistant turn, every assistant turn (default), or all tokens. "
                      "A learnt turn includes its end-of-turn token.")
    prep.add_argument("--overflow", default="truncate", choices=("truncate", "drop", "error"), help="--format: a "
                      "record longer than --seq-len is cut to it (default; dropped if no target token is left), "
                      "dropped, or an error. Counted in the summary.")
    prep.add_argument("--pack", action=argparse.BooleanOptionalAction, default=None, help="--format: several "
                      "records in each row of --seq-len tokens (best-fit decreasing), each keeping its own positions "
                      "and attending only to itself: the default, as it trains several times faster at the same loss "
                      "(docs/finetune.md#packing-records); train.global_batch_size counts rows, so a step holds "
                      "several records a row. --no-pack: one record per row, padded per batch. Records longer than "
                      "--seq-len still follow --overflow.")
    prep.add_argument("--prompt-field", default="", help="--format prompt-response: the prompt's field (default: "
                      "prompt, or alpaca's instruction followed by its input).")
    prep.add_argument("--response-field", default="", help="--format prompt-response: the response's field "
                      "(default: response, completion or alpaca's output).")
    prep.add_argument("--messages-field", default="", help="--format chat: the field holding the message list "
                      "(default: messages, openai's role/content, or conversations, sharegpt's from/value).")
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
    ins.add_argument("--tokens", type=int, default=0, metavar="N", help="Show the first N tokens of the first "
                     "train row, one a line, each beside the label it is trained to predict (- = none: -100).")
    ins.add_argument("--json", action="store_true", help="Print JSON instead of text.")
    ins.set_defaults(func=run_inspect)


def run_prepare(args) -> int:
    from raydl.data.prepare import prepare
    from raydl.data.prepare_records import RecordFormat
    from raydl.errors import DataError

    records = None
    if args.pack is True and not args.format:
        why = "its text is already cut into full rows of --seq-len tokens" if args.kind in ("text", "jsonl") else \
            "its rows are not token records"
        raise DataError(f"--pack packs fine-tuning records (--from jsonl --format text|prompt-response|chat) into "
                        f"rows, each record attending only to itself; --from {args.kind} without --format has no "
                        f"records to pack ({why}). Fix: drop --pack, or pass --from jsonl --format FORMAT "
                        f"--tokenizer DIR.")
    if args.format:
        if args.kind != "jsonl":
            raise DataError(f"--format {args.format} reads JSON-lines records, but --from is {args.kind}. Fix: pass "
                            f"--from jsonl.")
        records = RecordFormat(format=args.format, seq_len=args.seq_len, train_on=args.train_on,
                               overflow=args.overflow, text_field=args.column, prompt_field=args.prompt_field,
                               response_field=args.response_field, messages_field=args.messages_field,
                               pack=args.pack is not False)
    manifest = prepare(args.kind, args.src, args.out, shard_rows=args.shard_rows, column=args.column,
                       seq_len=args.seq_len, tokenizer=args.tokenizer, vocab_size=args.vocab_size,
                       keep_columns=args.keep_columns, records=records, progress=not args.quiet)
    splits = ", ".join(f"{k} {v['rows']:,} rows / {len(v['shards'])} shard(s)" for k, v in manifest["splits"].items())
    log.info(f"wrote {args.out}: {manifest['task']} data, {splits}")
    if records:
        c = manifest["records"]
        log.info(f"records: {c['records']:,} read, {c['truncated']:,} truncated and {c['dropped']:,} dropped "
                 f"(longer than --seq-len {args.seq_len}, --overflow {args.overflow}); {c['target_tokens']:,} "
                 f"target tokens; {c['rows']:,} rows{' packed' if c['packed'] else ''}, {c['fill']:.1%} of their "
                 f"slots real tokens")
        if c["packed"] and c["rows"]:
            per_row = (c["records"] - c["dropped"]) / c["rows"]
            log.info(f"{per_row:.1f} records a row: a step of train.global_batch_size rows holds that many times "
                     f"the records it held unpacked (divide it by {per_row:.1f} to keep the tokens of a step)")
    return 0


def run_inspect(args) -> int:
    from raydl.data.inspect import format_report, inspect

    report = inspect(args.path, verify=args.verify, tokens=args.tokens)
    print(json.dumps(report, indent=1, default=str) if args.json else format_report(report))
    return 0
