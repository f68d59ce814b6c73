"""Host memory that a worker frees goes back to the operating system.

glibc serves an allocation from its heap unless it is at least M_MMAP_THRESHOLD bytes, and by default it raises
that threshold (up to 32 MiB) each time a large block is freed. A training step frees layer-sized blocks by the
hundred (FSDP's unsharded parameters and gradients, activations): after the first step they land in the heap,
which fragments and keeps them. Measured on this machine, a 302M-parameter gpt under FSDP at dp=2: each worker's
resident peak grew 2249 -> 2459 -> 2977 MiB over 1, 2 and 5 steps with glibc's default, and stayed at 1615 MiB
with a fixed 64 KiB threshold, 1681 MiB with 1 MiB (benchmarks/results/memory-cpu.json). A fixed threshold also
turns off the adjustment, so the number holds for the whole run.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging

log = logging.getLogger(__name__)

M_MMAP_THRESHOLD = -3   # glibc's malloc.h


def return_large_blocks(threshold_kib: int) -> bool:
    """Serve host allocations of at least `threshold_kib` KiB by mmap (freed straight back to the OS); 0 leaves
    glibc's default. False where the C library is not glibc (musl, macOS): nothing to change there."""
    if threshold_kib <= 0:
        return False
    name = ctypes.util.find_library("c")
    try:
        mallopt = ctypes.CDLL(name).mallopt
    except (OSError, AttributeError, TypeError):
        return False
    if mallopt(M_MMAP_THRESHOLD, threshold_kib * 1024) != 1:
        log.warning(f"train.host_mmap_threshold_kib={threshold_kib}: glibc refused it (its limit is 32768); "
                    "glibc's default stays")
        return False
    return True
