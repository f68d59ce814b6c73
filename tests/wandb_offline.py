"""Reads a W&B offline run back (tests only): wandb 0.31 ships no reader of its own run-<id>.wandb file.

The file is a LevelDB-style log (what `wandb sync` uploads): a 7-byte header (":W&B", a magic, a version), then
records in 32 KiB blocks, each with a 7-byte header (crc32, little-endian length, kind: 1 full, 2 first, 3 middle,
4 last), a record split where a block ends; each whole record is a `wandb_internal_pb2.Record` protobuf."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

BLOCK, HEADER = 32768, 7


def records(path: Path) -> list:
    from wandb.proto import wandb_internal_pb2 as pb

    data = path.read_bytes()
    assert data[:4] == b":W&B", path
    pos, out, pending = HEADER, [], b""
    while pos + HEADER <= len(data):
        left = BLOCK - pos % BLOCK
        if left < HEADER:            # a block's tail too short for a header is padding
            pos += left
            continue
        length, kind = int.from_bytes(data[pos + 4:pos + 6], "little"), data[pos + 6]
        if kind == 0:                # zeros to the end of the block
            pos += left
            continue
        pending += data[pos + HEADER:pos + HEADER + length]
        pos += HEADER + length
        if kind in (1, 4):
            record = pb.Record()
            record.ParseFromString(pending)
            out.append(record)
            pending = b""
    return out


def offline_run(wandb_dir: Path) -> dict[str, Any]:
    """The one offline run under `wandb_dir` (…/wandb): its config, history rows by step, tags, summary, saved files."""
    [run_file] = list(wandb_dir.glob("offline-run-*/run-*.wandb"))
    run: dict[str, Any] = {"config": {}, "history": {}, "tags": set(), "summary": {}, "files": set(), "id": None}
    for r in records(run_file):
        kind = r.WhichOneof("record_type")
        if kind == "run":
            run["id"], run["group"] = r.run.run_id, r.run.run_group
            run["tags"] |= set(r.run.tags)
            run["config"].update({i.key: json.loads(i.value_json) for i in r.run.config.update})
        elif kind == "config":
            run["config"].update({i.key: json.loads(i.value_json) for i in r.config.update})
        elif kind == "history":
            row = {"/".join(i.nested_key) or i.key: json.loads(i.value_json) for i in r.history.item}
            run["history"][row["_step"]] = row
        elif kind == "summary":
            run["summary"].update({"/".join(i.nested_key) or i.key: json.loads(i.value_json) for i in r.summary.update})
        elif kind == "files":
            run["files"] |= {f.path for f in r.files.files}
    return run
