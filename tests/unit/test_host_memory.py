"""train.host_mmap_threshold_kib: freed layer-sized blocks go back to the OS (raydl.train.host_memory)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from raydl.overrides import load_config
from raydl.errors import ConfigError
from raydl.train.host_memory import AUTO_KIB, return_large_blocks, threshold_for

# A step's pattern in small: a large block freed (glibc then raises its mmap threshold to that size), then many
# layer-sized blocks, all but the last freed. The heap cannot trim below the live last one.
PATTERN = """
import sys, torch
from raydl.train.host_memory import AUTO_KIB, return_large_blocks, threshold_for
return_large_blocks(int(sys.argv[1]))
def rss_mib():
    return int(open("/proc/self/statm").read().split()[1]) * 4096 / 2**20
big = torch.ones(4 * 2**20); del big                      # 16 MiB, mapped and unmapped
before = rss_mib()
blocks = [torch.ones(2 * 2**20) for _ in range(40)]      # 40 x 8 MiB
del blocks[:-1]
print(rss_mib() - before)
"""


def kept_mib(threshold_kib: int) -> float:
    done = subprocess.run([sys.executable, "-c", PATTERN, str(threshold_kib)], capture_output=True, text=True,
                          check=True, env={"OMP_NUM_THREADS": "1", "PATH": ""})
    return float(done.stdout)


@pytest.mark.slow   # two processes that allocate and free 312 MiB
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc")
def test_freed_blocks_return_to_the_os_with_a_fixed_threshold():
    default, fixed = kept_mib(0), kept_mib(1024)
    assert default > 200, default      # glibc's default keeps the 39 freed blocks (312 MiB) in its heap
    assert fixed < 40, fixed           # the live one (8 MiB) and little else


def test_auto_fixes_it_where_fsdp_pipelines_or_offload_free_large_blocks():
    assert threshold_for("auto", wrapper="fsdp", pp=1, cpu_offload=False) == AUTO_KIB
    assert threshold_for("auto", wrapper="replicate", pp=2, cpu_offload=False) == AUTO_KIB
    assert threshold_for("auto", wrapper="ddp", pp=1, cpu_offload=True) == AUTO_KIB
    assert threshold_for("auto", wrapper="ddp", pp=1, cpu_offload=False) == 0
    assert threshold_for("auto", wrapper="none", pp=1, cpu_offload=False) == 0
    assert threshold_for(256, wrapper="ddp", pp=1, cpu_offload=False) == 256
    assert threshold_for(0, wrapper="fsdp", pp=1, cpu_offload=False) == 0


def test_zero_leaves_glibc_alone_and_the_field_is_checked():
    assert return_large_blocks(0) is False
    assert load_config(None, []).train.host_mmap_threshold_kib == "auto"
    assert load_config(None, ["train.host_mmap_threshold_kib=2048"]).train.host_mmap_threshold_kib == 2048
    for bad in ("65536", "big"):
        with pytest.raises(ConfigError, match="train.host_mmap_threshold_kib"):
            load_config(None, [f"train.host_mmap_threshold_kib={bad}"])
