"""Running the documentation's bash blocks as a reader of the page would (tests/docs_blocks.py parses them): in a
directory that looks like the checkout, with the repository's venv first on PATH. tests/ray/test_docs.py runs every
page's blocks so; a test that a block's `tested by` marker names runs that block so, then checks what it made."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

from tests.docs_blocks import REPO, Block, page_blocks

COMMAND_TIMEOUT_S = 600   # a loaded 2-core machine: ten times the quiet time
ENV = {"ONEDNN_MAX_CPU_ISA": "AVX512_CORE_BF16", "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}


def checkout_like(tmp_path: Path, data_cache: Path) -> Path:
    """`tmp_path` with links to the checkout's tracked top-level files and folders (so that `examples.my_model:spec`
    and `jobs/configs/...` resolve) and to the session's built-in dataset cache; `runs/` and `data/` are its own."""
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


def run_blocks(blocks: list[Block], cwd: Path, ray_address: str | None, *,
               extra_sets: tuple[str, ...] | list[str] = ()) -> None:
    """Every command of `blocks`, in order, in `cwd`: each must exit 0 (the failure names the page, the line and
    the command's output). `extra_sets`: `--set`s a test adds at the end of each `raydl train` (its own dataset, a
    shorter evaluation), which must end its command line."""
    for block in blocks:
        for command in block.commands:
            if extra_sets and "raydl train " in command:
                command += "".join(f" --set {s}" for s in extra_sets)
            t0 = time.monotonic()
            done = run(command, cwd, ray_address)
            print(f"{block.page}:{block.line} {time.monotonic() - t0:5.1f} s  {command}")
            assert done.returncode == 0, (f"{block.page}:{block.line}: `{command}` exited {done.returncode}:\n"
                                          + "\n".join(done.stdout.splitlines()[-40:]))


def blocks_tested_by(page: str, test: str) -> list[Block]:
    """The blocks of `page` (relative to the checkout) whose marker names `test` ("tests/x.py::test_y"): the
    commands that test runs for the page, which test_docs.py does not."""
    found = [block for block in page_blocks(REPO / page) if block.tested_by == test]
    assert found, f"{page} has no block marked `<!-- tested by: {test} -->`"
    return found
