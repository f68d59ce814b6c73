"""`raydl data inspect DIR`: schema, rows, shards, size and a sample row; `--verify` checks checksums."""

from __future__ import annotations

from typing import Any

import pyarrow.parquet as pq

from raydl.checksum import sha256_stream
from raydl.data.dataset import DatasetInfo, open_dataset
from raydl.data.tokenizer import decoder
from raydl.errors import DataError


def inspect(path: str, *, verify: bool = False) -> dict[str, Any]:
    info = open_dataset(path)
    fs, root = info.filesystem()
    meta = {k: v for k, v in info.meta.items() if k not in ("schema", "splits")}
    splits = {}
    for name, shards in info.splits.items():
        files = [f"{root.rstrip('/')}/{s.file}" for s in shards]
        splits[name] = {"rows": info.rows(name), "shards": len(shards),
                        "bytes": sum(i.size or 0 for i in fs.get_file_info(files))}
    report = {"path": path, "meta": meta, "schema": info.meta["schema"], "splits": splits,
              "rows": sum(s["rows"] for s in splits.values()), "bytes": sum(s["bytes"] for s in splits.values()),
              "sample": sample_row(info)}
    if verify:
        report["verified_shards"] = verify_checksums(info)
    return report


def sample_row(info: DatasetInfo) -> dict[str, Any]:
    fs, root = info.filesystem()
    with fs.open_input_file(f"{root.rstrip('/')}/{info.splits['train'][0].file}") as f:
        row = pq.ParquetFile(f).read_row_group(0).slice(0, 1).to_pylist()[0]
    out = {}
    for key, value in row.items():
        if isinstance(value, list) and len(value) > 16:
            out[key] = f"[{', '.join(map(str, value[:16]))}, ...] ({len(value)} values)"
        else:
            out[key] = value
    decode = decoder(info)
    if decode is not None:
        out["text"] = decode(row["input_ids"])[:200]
    if "classes" in info.meta and "label" in row:
        out["class"] = info.meta["classes"][row["label"]]
    return out


def verify_checksums(info: DatasetInfo) -> int:
    """Re-hash every shard against manifest.json (reads the whole dataset once); returns the number checked."""
    fs, root = info.filesystem()
    shards = [s for split in info.splits.values() for s in split if s.sha256]
    for shard in shards:
        path = f"{root.rstrip('/')}/{shard.file}"
        with fs.open_input_stream(path) as f:
            digest = sha256_stream(f)
        if digest != shard.sha256:
            raise DataError(f"shard '{path}' does not match its sha256 in manifest.json: it was changed or "
                            f"corrupted. Fix: re-create the dataset with `raydl data prepare`, or set "
                            f"data.max_bad_shards to skip it in training.")
    return len(shards)


def format_report(r: dict[str, Any]) -> str:
    lines = [f"dataset {r['path']}: {r['meta'].get('task')} data, {r['rows']:,} rows, {r['bytes'] / 1e6:.1f} MB"]
    lines.append("  meta: " + ", ".join(f"{k}={v}" for k, v in r["meta"].items() if k not in ("format", "rows")))
    lines.append("  schema: " + ", ".join(f"{k}: {v}" for k, v in r["schema"].items()))
    for name, s in r["splits"].items():
        lines.append(f"  {name}: {s['rows']:,} rows in {s['shards']} shard(s), {s['bytes'] / 1e6:.1f} MB")
    if "verified_shards" in r:
        lines.append(f"  checksums: {r['verified_shards']} shard(s) match manifest.json")
    lines.append("  sample (first train row):")
    lines.extend(f"    {k}: {v}" for k, v in r["sample"].items())
    return "\n".join(lines)
