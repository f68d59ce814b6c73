"""Checkpoint safety: only complete, intact checkpoints load; a corrupt newest one falls back to the
previous with a warning naming both; a checkpoint from another model is refused."""

from __future__ import annotations

import json

import pytest
import torch

from raydl.checksum import sha256_file
from raydl.errors import CheckpointError
from raydl.models.gpt import build_gpt
from raydl.train import checkpoint as ckpt
from tests.helpers import raydl_warns


def tiny_state(step: int) -> dict:
    """The trainer state raydl's loop saves, for one rank and 8 samples per step."""
    return {"step": step, "samples": 8 * step, "position": {"epoch": 0, "offset": 8 * step}, "model": {"name": "gpt"},
            "layout": {"world_size": 1, "dp": 1, "pp": 1}, "scaler": None, "lr": 3e-4, "saved_by_ranks": 1}


def save_step(run_dir, step: int):
    torch.manual_seed(step)
    model = build_gpt("tiny", vocab_size=16, seq_len=8)
    optimizer = torch.optim.AdamW(model.parameters())
    path = run_dir / "train" / ckpt.checkpoint_name(step)
    ckpt.save(path, model, optimizer, tiny_state(step), rank=0)
    return path


def reseal(path) -> None:
    """Rewrite every rank's manifest for its files as they are now, as a forger would."""
    for manifest in path.glob("files-rank*.json"):
        names = json.loads(manifest.read_text())
        manifest.write_text(json.dumps({n: [(path / n).stat().st_size, sha256_file(path / n)] for n in names}))


def test_corrupt_newest_falls_back_to_previous(tmp_path):
    old, new = save_step(tmp_path, 10), save_step(tmp_path, 20)
    assert ckpt.verify(old) is None and ckpt.verify(new) is None
    shard = next(new.glob("__0_*.distcp"))
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    with raydl_warns(f"{new}.*falling back to {old}"):
        assert ckpt.resolve_resume(str(tmp_path)) == old.resolve()


def test_half_written_checkpoint_is_never_loaded(tmp_path):
    old, new = save_step(tmp_path, 10), save_step(tmp_path, 20)
    (new / ckpt.STATE_FILE).unlink()           # killed before rank 0 wrote its state
    assert ckpt.find_latest(tmp_path) == old
    (old / "files-rank0.json").unlink()          # a shard manifest missing: not intact either
    with raydl_warns(), pytest.raises(CheckpointError, match="no usable checkpoint"):
        ckpt.resolve_resume(str(tmp_path))


def test_checkpoint_from_another_model_is_refused(tmp_path):
    path = save_step(tmp_path, 5)
    state = json.loads((path / ckpt.STATE_FILE).read_text())
    with pytest.raises(CheckpointError, match="saved from model"):
        ckpt.check_compatible(state, {"name": "resnet"}, path)


def test_load_restores_parameters_into_a_fresh_model(tmp_path):
    path = save_step(tmp_path, 7)
    torch.manual_seed(7)
    expected = build_gpt("tiny", vocab_size=16, seq_len=8).state_dict()
    torch.manual_seed(99)
    model = build_gpt("tiny", vocab_size=16, seq_len=8)
    state = ckpt.load(path, model, torch.optim.AdamW(model.parameters()), {"name": "gpt"})
    assert state["step"] == 7
    for name, tensor in model.state_dict().items():
        assert torch.equal(tensor, expected[name]), name
