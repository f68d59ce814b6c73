"""Every command of the README and the guides runs as documented (tests/docs_blocks.py says which).

Each page gets a fresh directory that looks like the checkout (links to its tracked top-level files, so
`examples.my_model:spec` and `jobs/configs/...` resolve) and shares the session's built-in dataset cache;
its blocks run there in order, one bash per command, with the repository's venv first on PATH."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.docs_blocks import REPO, DocsError, page_blocks, pages

COMMAND_TIMEOUT_S = 600   # a loaded 2-core machine: ten times the quiet time
ENV = {"ONEDNN_MAX_CPU_ISA": "AVX512_CORE_BF16", "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}


def checkout_like(tmp_path: Path, data_cache: Path) -> Path:
    tracked = subprocess.run(["git", "ls-files"], cwd=REPO, capture_output=True, text=True, check=True).stdout
    for name in sorted({line.split("/")[0] for line in tracked.splitlines()}):
        (tmp_path / name).symlink_to(REPO / name)
    (tmp_path / ".raydl_data").symlink_to(data_cache)   # the built-in datasets, generated once per session
    return tmp_path


def run(command: str, cwd: Path, ray_address: str | None) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RAY_ADDRESS", "RAYDL_"))}
    env.update(ENV, PATH=f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}")
    if ray_address:
        env["RAY_ADDRESS"] = ray_address
    return subprocess.run(["bash", "-o", "pipefail", "-c", command], cwd=cwd, env=env, text=True,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=COMMAND_TIMEOUT_S)


def runs_here(page: Path) -> bool:
    """A page with a bash block that no other test runs (a block marked `tested by` runs in the test it names), or
    with none that a test runs, so that its test fails; a page that does not parse is run too, so that its test
    fails (not the collection)."""
    try:
        parsed = page_blocks(page)
    except DocsError:
        return True
    return (any(block.skip_reason is None and block.tested_by is None for block in parsed)
            or not any(block.tested_by for block in parsed))


@pytest.mark.slow
@pytest.mark.timeout(1800)
@pytest.mark.parametrize("page", [p for p in pages() if runs_here(p)], ids=lambda p: p.name)
def test_documented_commands_pass(page, tmp_path, data_cache, shared_ray_address):
    parsed = page_blocks(page)   # parsed here: a bad page fails its test, not collection
    runnable = [block for block in parsed if block.skip_reason is None and block.tested_by is None]
    assert runnable, f"{page.name}: every command is marked 'not tested'; a page shows at least one that runs"
    cwd = checkout_like(tmp_path, data_cache)
    # The pages' runs join the session's Ray (RAY_ADDRESS, as a user's shell may set it); the README's run, on the
    # private Ray a first `raydl train` starts, is tests/ray/test_console.py's.
    for block in runnable:
        for command in block.commands:
            t0 = time.monotonic()
            done = run(command, cwd, shared_ray_address)
            print(f"{block.page}:{block.line} {time.monotonic() - t0:5.1f} s  {command}")
            assert done.returncode == 0, (f"{block.page}:{block.line}: `{command}` exited {done.returncode}:\n"
                                          + "\n".join(done.stdout.splitlines()[-40:]))
