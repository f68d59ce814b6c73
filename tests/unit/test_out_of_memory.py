"""A worker's allocation failure becomes raydl's paragraph (raydl.errors.out_of_memory, raised by
raydl.train.loop.memory_errors): which worker, what it was doing, the size that failed, the cap when one is set,
and what to change; it survives the pickling that carries it from a Ray worker to the driver."""

from __future__ import annotations

import pickle
import resource

import pytest
import torch

from raydl.errors import OutOfMemory, is_out_of_memory, out_of_memory, raydl_error_in
from raydl.train.host_memory import cap_growth
from raydl.train.loop import memory_errors


def _cpu_allocation_failure() -> RuntimeError:
    return RuntimeError("[enforce fail at alloc_cpu.cpp:127] err == 0. DefaultCPUAllocator: can't allocate memory: "
                        "you tried to allocate 16777216 bytes. Error code 12 (Cannot allocate memory)")


def test_allocation_failures_are_recognised_and_other_errors_are_not():
    assert is_out_of_memory(_cpu_allocation_failure())
    assert is_out_of_memory(MemoryError())
    assert is_out_of_memory(torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"))
    assert not is_out_of_memory(RuntimeError("shape mismatch"))
    assert not is_out_of_memory(ValueError("can't allocate memory"))


def test_the_paragraph_names_the_worker_the_size_the_cap_and_the_fix():
    error = out_of_memory(_cpu_allocation_failure(), rank=1, during="training", limit_mb=405)
    text = str(error)
    assert text.startswith("worker 1 ran out of host memory while training: an allocation of 16.0 MiB failed.")
    assert "405 MiB" in text and "debug.memory_limit_mb" in text
    assert "parallel.dp_wrapper=fsdp" in text and "train.optimizer_in_backward=true" in text
    assert error.exit_code == 1 and "enforce fail" not in text
    gpu = str(out_of_memory(torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"), rank=0,
                            during="training"))
    assert "ran out of GPU memory" in gpu and "Tried to allocate 2.00 GiB" in gpu and "memory_limit_mb" not in gpu
    copy = pickle.loads(pickle.dumps(error))
    assert isinstance(copy, OutOfMemory) and str(copy) == text


def test_memory_errors_converts_an_allocation_failure_and_lets_others_through():
    job = {"config": {"debug": {"memory_limit_mb": 0}}}
    with pytest.raises(OutOfMemory, match="while building and loading its model") as caught:
        with memory_errors(job, "building and loading its model"):
            raise _cpu_allocation_failure()
    assert raydl_error_in(caught.value) is caught.value
    with pytest.raises(KeyError):
        with memory_errors(job, "training"):
            raise KeyError("not memory")


def test_cap_growth_makes_an_allocation_beyond_it_fail():
    soft, hard = resource.getrlimit(resource.RLIMIT_DATA)
    try:
        assert cap_growth(0) is None
        assert cap_growth(64) is not None
        kept = torch.empty(16 * 2**20 // 4)   # 16 MiB of the 64
        with pytest.raises(RuntimeError, match="can't allocate memory"):
            torch.empty(128 * 2**20 // 4)
        del kept
    finally:
        resource.setrlimit(resource.RLIMIT_DATA, (soft, hard))
