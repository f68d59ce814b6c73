"""Host memory that a worker frees goes back to the operating system.

glibc serves an allocation from its heap unless it is at least M_MMAP_THRESHOLD bytes, and by default it raises
that threshold (up to 32 MiB) each time a large block is freed. A training step frees layer-sized blocks by the
hundred (FSDP's unsharded parameters and gradients, activations): after the first step they land in the heap,
which fragments and keeps them. `raydl bench memory`, a 302M gpt at dp=2 FSDP: each worker's whole-run peak above a
tiny model's run was 2.1x the fp32 model with glibc's default and 1.14x (its predicted live tensors, +0%) with 1 MiB
(benchmarks/results/memory-cpu.json). A fixed threshold also turns the adjustment off, so it holds for the whole run.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import resource

from raydl.telemetry.memory_marks import proc_status_kib

log = logging.getLogger(__name__)

M_MMAP_THRESHOLD = -3   # glibc's malloc.h


AUTO_KIB = 1024


def threshold_for(setting: int | str, *, wrapper: str, pp: int, cpu_offload: bool) -> int:
    """train.host_mmap_threshold_kib resolved for a worker's layout. `auto` fixes it where a step frees large host
    blocks by the hundred (FSDP2's gathered layers and unsharded gradients, a pipeline's per-micro-batch
    activations and messages, offloaded state) and leaves glibc's default for classic DDP and a single worker,
    where mapping every large block costs page faults and saved nothing measurable (`raydl bench host_memory`)."""
    if setting != "auto":
        return int(setting)
    return AUTO_KIB if wrapper == "fsdp" or pp > 1 or cpu_offload else 0


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
        log.warning(f"train.host_mmap_threshold_kib={threshold_kib}: glibc refused it; glibc's default stays")
        return False
    return True


def cap_growth(limit_mib: int) -> int | None:
    """debug.memory_limit_mb: from now on this process may allocate at most `limit_mib` MiB more than it holds now,
    or an allocation fails (torch: "DefaultCPUAllocator: can't allocate memory"). The cap is RLIMIT_DATA, which counts
    exactly a process's private writable memory (malloc's heap and mappings, thread stacks), not what it shares (Ray's
    object store) or maps read-only (code, safetensors). Returns the limit set in bytes; None when off or without
    /proc."""
    held_kib = proc_status_kib("VmData") if limit_mib > 0 else None
    if held_kib is None:
        return None
    limit = held_kib * 1024 + limit_mib * 2**20
    resource.setrlimit(resource.RLIMIT_DATA, (limit, resource.getrlimit(resource.RLIMIT_DATA)[1]))
    return limit
