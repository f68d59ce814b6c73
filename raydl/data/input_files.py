"""The input side of `raydl data prepare`: which files a --from argument names, and a progress line."""

from __future__ import annotations

import glob
import os
import sys
import time
from pathlib import Path

from raydl.errors import DataError


class Progress:
    """One self-overwriting stderr line, at most twice a second."""

    def __init__(self, total_files: int, enabled: bool = True):
        self.total, self.enabled = total_files, enabled
        self.files = self.rows = self.bytes = 0
        self.t0 = self.t_last = time.time()

    def update(self, *, files: int = 0, rows: int = 0, nbytes: int = 0, force: bool = False) -> None:
        self.files, self.rows, self.bytes = self.files + files, self.rows + rows, self.bytes + nbytes
        now = time.time()
        if self.enabled and (force or now - self.t_last > 0.5):
            self.t_last = now
            print(f"\r[raydl] prepare: {self.files}/{self.total} files, {self.rows:,} rows, "
                  f"{self.bytes / 1e6:.1f} MB read, {now - self.t0:.0f}s", end="", file=sys.stderr, flush=True)

    def close(self) -> None:
        self.update(force=True)
        if self.enabled:
            print(file=sys.stderr, flush=True)


def list_sources(src: str, kind: str) -> list[Path]:
    """Input files, sorted; a glob, one file or a directory (searched recursively)."""
    if any(c in src for c in "*?["):
        files = sorted(Path(p) for p in glob.glob(src, recursive=True) if os.path.isfile(p))
        if not files:
            raise DataError(f"--from {kind} '{src}' matches no files. Fix: check the pattern (quote it so the "
                            f"shell does not expand it).")
        return files
    path = Path(src)
    if not path.exists():
        raise DataError(f"--from {kind} '{src}' does not exist. Fix: give an existing file, directory or glob.")
    if path.is_file():
        return [path]
    files = sorted(p for p in path.rglob("*") if p.is_file() and not p.name.startswith("."))
    if not files:
        raise DataError(f"--from {kind} '{src}' is an empty directory. Fix: put the input files in it or give "
                        f"another path.")
    return files
