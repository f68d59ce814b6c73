"""sha256 of files and streams, read in chunks so memory stays flat for multi-GB shards."""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import BinaryIO

CHUNK = 1 << 22


def sha256_stream(f: BinaryIO) -> str:
    digest = hashlib.sha256()
    for chunk in iter(lambda: f.read(CHUNK), b""):
        digest.update(chunk)
    return digest.hexdigest()


def sha256_file(path: str | Path) -> str:
    with open(path, "rb") as f:
        return sha256_stream(f)
