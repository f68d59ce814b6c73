"""The input side of `raydl data prepare`: which files a --from argument names, and a progress line."""

from __future__ import annotations

import glob
import logging
import os
import sys
import time
from pathlib import Path
from typing import Iterator

from raydl.errors import DataError

log = logging.getLogger(__name__)


class Progress:
    """One self-overwriting stderr line, at most twice a second. Not a log line (it rewrites itself in place),
    but it shows only where raydl's info lines do (not under --quiet)."""

    def __init__(self, total_files: int, enabled: bool = True):
        self.total, self.enabled = total_files, enabled and log.isEnabledFor(logging.INFO)
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
    """Input files, sorted: one file, a directory (searched recursively, following symlinks), or a
    glob. A path that exists is taken as it is, so a file name may contain glob characters (`[`)."""
    path = Path(src)
    if path.is_file():
        return [path]
    if path.is_dir():
        files = sorted(_walk(path, ()))
        if not files:
            raise DataError(f"--from {kind} '{src}' is an empty directory. Fix: put the input files in it or give "
                            f"another path.")
    elif glob.has_magic(src):
        files = sorted(Path(p) for p in glob.glob(src, recursive=True) if os.path.isfile(p))
        if not files:
            bracket = " A '[' starts a character class: write '[[]' for a literal '['." if "[" in src else ""
            raise DataError(f"--from {kind} '{src}' matches no files. Fix: check the pattern (quote it so the "
                            f"shell does not expand it).{bracket}")
    else:
        raise DataError(f"--from {kind} '{src}' does not exist. Fix: give an existing file, directory or glob.")
    _refuse_repeats(src, kind, files)
    return files


def source_root(src: str) -> Path:
    """The directory an input is relative to: `src` itself, or a glob's leading part without wildcards."""
    if Path(src).exists() or not glob.has_magic(src):
        return Path(src)
    parts = Path(src).parts
    literal = next(i for i, part in enumerate(parts) if glob.has_magic(part))
    return Path(*parts[:literal]) if literal else Path(".")


def _walk(directory: Path, ancestors: tuple[tuple[int, int], ...]) -> Iterator[Path]:
    """Files under `directory` (not hidden ones), following symlinks; a link back to a directory above
    it (a loop) is a DataError rather than an endless walk."""
    here = directory.stat()
    ancestors = (*ancestors, (here.st_dev, here.st_ino))
    with os.scandir(directory) as entries:
        for entry in entries:
            if entry.is_dir():
                there = entry.stat()
                if (there.st_dev, there.st_ino) in ancestors:
                    raise DataError(f"'{entry.path}' links back to '{os.path.realpath(entry.path)}', a directory "
                                    f"it is inside (a symlink loop), so the input has no end. Fix: remove that "
                                    f"link, or point --from at a directory without loops.")
                yield from _walk(Path(entry.path), ancestors)
            elif entry.is_file() and not entry.name.startswith("."):
                yield Path(entry.path)


def _refuse_repeats(src: str, kind: str, files: list[Path]) -> None:
    """One file reached by two paths (two links to it, or a glob through a symlink loop) would put
    its rows in the dataset twice."""
    seen: dict[str, Path] = {}
    for path in files:
        first = seen.setdefault(os.path.realpath(path), path)
        if first != path:
            first, path = sorted((first, path), key=lambda p: len(str(p)))
            raise DataError(f"--from {kind} '{src}' reaches the same file as '{first}' and '{path}' (a symlink "
                            f"loop or a second link), so its rows would be in the dataset twice. Fix: remove the "
                            f"extra link or loop, or narrow the pattern.")
