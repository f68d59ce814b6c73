"""`raydl data inspect DIR`: schema, rows, shards, size and a sample row; `--verify` checks checksums."""

from __future__ import annotations

from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from raydl.checksum import sha256_stream
from raydl.data.columns import DOCUMENTS
from raydl.data.dataset import DatasetInfo, open_dataset
from raydl.data.tokenizer import decoder, token_names
from raydl.errors import DataError, one_line


def inspect(path: str, *, verify: bool = False, tokens: int = 0) -> dict[str, Any]:
    info = open_dataset(path)
    fs, _ = info.filesystem()
    meta = {k: v for k, v in info.meta.items() if k not in ("schema", "splits")}
    splits = {}
    for name, shards in info.splits.items():
        splits[name] = {"rows": info.rows(name), "shards": len(shards),
                        "bytes": sum(i.size or 0 for i in fs.get_file_info(list(info.shard_paths[name])))}
    report = {"path": path, "meta": meta, "schema": info.meta["schema"], "splits": splits,
              "rows": sum(s["rows"] for s in splits.values()), "bytes": sum(s["bytes"] for s in splits.values()),
              "sample": sample_row(info)}
    if verify:
        report["verified_shards"] = verify_checksums(info)
    if tokens:
        report["tokens"] = token_view(info, tokens)
    return report


def token_view(info: DatasetInfo, n: int) -> list[dict[str, Any]]:
    """The first `n` positions of the first train row: the input token and the label it is trained to predict
    (None where the label is -100: nothing learnt there)."""
    row = first_row(info)
    if "input_ids" not in row or "labels" not in row:
        raise DataError(f"dataset '{info.root}' has no input_ids and labels columns, so it has no tokens to show. "
                        f"Fix: drop --tokens (it is for token datasets).")
    name = token_names(info)
    documents = row.get(DOCUMENTS) or [0] * len(row["input_ids"])     # packed rows: each token's record
    return [{"position": i, "id": t, "token": name(t), "label": None if label < 0 else label,
             "label_token": None if label < 0 else name(label), "record": d}
            for i, (t, label, d) in enumerate(zip(row["input_ids"][:n], row["labels"][:n], documents))]


def first_row(info: DatasetInfo) -> dict[str, Any]:
    """The first row of the first train shard, or a DataError naming the shard."""
    fs, _ = info.filesystem()
    path, listed = info.shard_paths["train"][0], info.splits["train"][0].rows
    try:
        with fs.open_input_file(path) as f:
            shard = pq.ParquetFile(f)
            table = shard.read_row_group(0) if shard.metadata.num_rows else None
    except (OSError, pa.ArrowException) as e:
        raise DataError(f"shard '{path}' (the first of the train split) cannot be read ({one_line(e)}): it is truncated or "
                        f"not parquet. Fix: re-create the dataset with `raydl data prepare` (`raydl data inspect "
                        f"--verify` checks every shard against its sha256).") from None
    if table is None or table.num_rows == 0:
        raise DataError(f"shard '{path}' (the first of the train split) has no rows, but manifest.json lists "
                        f"{listed}. Fix: re-create the dataset with `raydl data prepare`.")
    return table.slice(0, 1).to_pylist()[0]


def sample_row(info: DatasetInfo) -> dict[str, Any]:
    row = first_row(info)
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
    fs, _ = info.filesystem()
    shards = [(path, s) for split, paths in info.shard_paths.items()
              for path, s in zip(paths, info.splits[split]) if s.sha256]
    for path, shard in shards:
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
    if "tokens" in r:
        lines.append("  tokens of the first train row: position, id, token, and the label it learns to predict (- = none):")
        for t in r["tokens"]:
            if t["position"] and t["record"] != r["tokens"][t["position"] - 1]["record"]:
                lines.append(f"    --- record {t['record']} of the packed row ---")
            lines.append(f"    {t['position']:5d} {t['id']:7d} {t['token']:<20} -> "
                         + ("-" if t["label"] is None else f"{t['label']} {t['label_token']}"))
    return "\n".join(lines)
