"""User-facing errors: each says what is wrong, with the numbers, and how to fix it.

The CLI turns any `RaydlError` into one paragraph on stderr and exit code 2; a bare
traceback means a bug in raydl, not in the user's input.
"""

from __future__ import annotations


class RaydlError(Exception):
    """An error in the user's input (config, data, checkpoint, CLI); exit code 2."""

    exit_code = 2


class ConfigError(RaydlError, ValueError):
    def __init__(self, path: str, problem: str, fix: str):
        self.path, self.problem, self.fix = path, problem, fix
        super().__init__(f"config field '{path}' {problem}. Fix: {fix}.")

    def __reduce__(self):   # errors raised in Ray workers travel pickled to the driver
        return (type(self), (self.path, self.problem, self.fix))


class DataError(RaydlError, ValueError):
    """Bad dataset: missing, empty, not parquet, wrong schema, corrupt shard."""


class CheckpointError(RaydlError, ValueError):
    """A checkpoint that cannot be used: unreadable, incomplete or from another model."""


class LayoutError(RaydlError, ValueError):
    """A parallel layout that cannot run on this world size or model."""
