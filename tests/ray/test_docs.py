"""Every command of the README and the guides runs as documented (tests/docs_blocks.py says which).

Each page gets a fresh directory that looks like the checkout (links to its tracked top-level files, so
`examples.my_model:spec` and `jobs/configs/...` resolve) and shares the session's built-in dataset cache;
its blocks run there in order, one bash per command, with the repository's venv first on PATH (tests/docs_run.py,
which the tests that a block's `tested by` marker names run it with)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.docs_blocks import DocsError, page_blocks, pages
from tests.docs_run import checkout_like, run_blocks


def runs_here(page: Path) -> bool:
    """A page with a bash block that no other test runs (a block marked `tested by` runs in the test it names), or
    whose blocks are all `not tested`, or that does not parse: the last two fail their test (not the collection)."""
    try:
        parsed = page_blocks(page)
    except DocsError:
        return True
    runnable = any(block.skip_reason is None and block.tested_by is None for block in parsed)
    return runnable or (bool(parsed) and not any(block.tested_by for block in parsed))


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
    run_blocks(runnable, cwd, shared_ray_address)
