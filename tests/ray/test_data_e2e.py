"""prepare -> inspect -> train on small real text and image files; a corrupt shard found mid-run."""

from __future__ import annotations

import json

import pytest

from raydl.cli import main as cli
from raydl.train.checkpoint import find_latest, is_complete
from tests.ray.test_data_ledger import torchrun
from tests.unit.test_data_loader import corrupt, make_dataset
from tests.unit.test_data_prepare import write_images, write_texts

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("kind", ["text", "text-bpe", "images"])
def test_prepare_inspect_train(kind, tmp_path, capsys):
    src = write_texts(tmp_path / "txt") if kind != "images" else write_images(tmp_path / "img", per_class=80)
    data = tmp_path / "data"
    bpe = ["--tokenizer", "bpe", "--vocab-size", "300"] if kind == "text-bpe" else []
    assert cli(["data", "prepare", "--from", kind.split("-")[0], str(src), "--out", str(data), "--seq-len", "32",
                "--quiet", *bpe]) == 0
    assert cli(["data", "inspect", str(data), "--verify"]) == 0
    assert "checksums: 2 shard(s) match" in capsys.readouterr().out
    model = ["model.name=resnet"] if kind == "images" else ["model.name=gpt"]
    p = torchrun(1, tmp_path / "run", data, tmp_path, "train.max_steps=6", "train.global_batch_size=16",
                 "train.micro_batch_size=8", *model)
    assert p.returncode == 0, p.stderr[-3000:]
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["steps"] == 6 and summary["eval"]["batches"] >= 1
    assert 0 <= summary["data_wait_frac"] < 1


def test_corrupt_shard_mid_run_keeps_the_last_checkpoint(tmp_path):
    data = make_dataset(tmp_path)
    assert torchrun(1, tmp_path / "run", data, tmp_path, "train.max_steps=10").returncode == 0
    step10 = find_latest(tmp_path / "run")
    bad = corrupt(data, 1)
    p = torchrun(1, tmp_path / "run-1", data, tmp_path, "train.max_steps=32", resume=tmp_path / "run")
    assert p.returncode != 0 and f"shard '{bad}'" in p.stderr and "data.max_bad_shards" in p.stderr
    assert is_complete(step10)                     # nothing already trained is lost
    p = torchrun(1, tmp_path / "run-2", data, tmp_path, "train.max_steps=32", "data.max_bad_shards=1",
                 resume=tmp_path / "run")
    assert p.returncode == 0 and "resumed from" in p.stderr, p.stderr[-3000:]
    records = [json.loads(x) for x in (tmp_path / "run-2" / "metrics.jsonl").read_text().splitlines()]
    assert records[-1]["step"] == 32 and records[-1]["bad_shards"] == 1
