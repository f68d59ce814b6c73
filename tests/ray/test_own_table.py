"""A user's own parquet table and model on a real local Ray, as the README runs them: examples/make_table.py,
`raydl data prepare --from parquet`, `raydl train --set model.name=examples.mlp_regressor:spec`."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from raydl.cli import main

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_examples_mlp_regressor_trains_on_its_own_table(ray_session, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(REPO)
    raw, data = tmp_path / "raw" / "table.parquet", tmp_path / "table"
    subprocess.run([sys.executable, "examples/make_table.py", str(raw), "--rows", "4096"], check=True, timeout=60)
    assert main(["data", "prepare", "--from", "parquet", str(raw), "--out", str(data), "--quiet"]) == 0
    # data.backend=ray: Ray Data read tasks carry the table's variable-length and string columns too
    sets = ["model.name=examples.mlp_regressor:spec", f"data.path={data}", "data.backend=ray",
            f"run.runs_dir={tmp_path / 'runs'}", "train.max_steps=60", "train.lr=0.003", "train.warmup_steps=5",
            "checkpoint.every_steps=60", "train.eval_batches=2", "telemetry.progress=false"]
    assert main(["train", *(a for s in sets for a in ("--set", s))]) == 0
    out = capsys.readouterr().out
    summary = json.loads(out[out.find("\n{\n") + 1:])
    losses = [json.loads(line)["loss"] for line in (Path(summary["run_dir"]) / "metrics.jsonl").read_text().splitlines()]
    assert summary["steps"] == 60 and sum(losses[-5:]) < 0.25 * sum(losses[:5]), losses
