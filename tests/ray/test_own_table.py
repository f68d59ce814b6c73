"""A user's own parquet table and model on a real local Ray, as docs/own-model.md runs them (its blocks, read from
the page, as printed there): examples/make_table.py, `raydl data prepare --from parquet`, `raydl train --set
model.name=examples.mlp_regressor:spec` through Ray Data's reader, `raydl export` to pt2 and ONNX."""

from __future__ import annotations

import json

import pytest

from raydl.overrides import load_config
from tests.docs_run import blocks_tested_by, checkout_like, run_blocks

PAGE = "docs/own-model.md"


@pytest.mark.slow
def test_examples_mlp_regressor_trains_on_its_own_table(request, tmp_path, data_cache, shared_ray_address):
    cwd = checkout_like(tmp_path, data_cache)
    run_blocks(blocks_tested_by(PAGE, request.node.nodeid), cwd, shared_ray_address)
    run_dir = cwd / "runs" / "table"
    # data.backend=ray: Ray Data read tasks carry the table's variable-length and string columns too
    assert load_config(run_dir / "config.yaml").data.backend == "ray"
    summary = json.loads((run_dir / "summary.json").read_text())
    losses = [json.loads(line)["loss"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert summary["steps"] == 60 and sum(losses[-5:]) < 0.25 * sum(losses[:5]), losses
    assert (cwd / "exported" / "table" / "model.pt2").is_file()
    assert (cwd / "exported" / "table-onnx" / "model.onnx").is_file()
