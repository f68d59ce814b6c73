"""A checkpoint runs no code when loaded: `.metadata` is unpickled through an allowlist and the
non-tensor entries (optimizer hyperparameters) load with weights_only. Each crafted checkpoint
here is first shown to run its payload through torch's own DCP reader, then refused by raydl's,
naming the file and the class, with the payload's file never created."""

from __future__ import annotations

import json
import pickle
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict

from raydl.cli import main as cli_main
from raydl.errors import CheckpointError
from raydl.models.gpt import build_gpt
from raydl.train import checkpoint as ckpt
from raydl.train import safe_dcp
from tests.unit.test_checkpoint_safety import reseal, save_step, tiny_state
from tests.helpers import raydl_warns


class TouchOnLoad:
    """Unpickling it creates `path`: the stand-in for arbitrary code."""

    def __init__(self, path: Path):
        self.path = path

    def __reduce__(self):
        return (Path.touch, (self.path,))


def tiny_model_and_optimizer(seed: int):
    torch.manual_seed(seed)
    model = build_gpt("tiny", vocab_size=16, seq_len=8)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3)


def forge_metadata(path: Path, marker: Path) -> None:
    """The real metadata, plus an object that creates `marker` when unpickled."""
    with (path / ".metadata").open("rb") as f:
        metadata = pickle.load(f)
    metadata.storage_meta.modules = [TouchOnLoad(marker)]
    (path / ".metadata").write_bytes(pickle.dumps(metadata))
    reseal(path)


def torch_dcp_load(path: Path, *, hyperparameters: bool = False) -> None:
    """torch's own DCP reader on `path`, asking for what raydl saves (hyperparameters: the form it saved before)."""
    model, optimizer = tiny_model_and_optimizer(0)
    msd, osd = get_state_dict(model, optimizer, options=ckpt.FLAT_OPTIMIZER)
    dcp.load({"model": msd, "optim": osd if hyperparameters else ckpt.optimizer_states(osd)}, checkpoint_id=str(path))


def trained_model_and_optimizer(seed: int):
    model, optimizer = tiny_model_and_optimizer(seed)
    model(torch.randint(0, 16, (2, 8))).float().pow(2).mean().backward()
    optimizer.step()
    return model, optimizer


def save_rewritten(path: Path, model, optimizer, change=lambda osd: osd) -> None:
    """A checkpoint of raydl's whose shards are written again from torch's flat optimizer state, hyperparameters
    included (the form raydl saved before 2026-11-28), after `change`."""
    ckpt.save(path, model, optimizer, tiny_state(1), rank=0)
    msd, osd = get_state_dict(model, optimizer, options=ckpt.FLAT_OPTIMIZER)
    dcp.save({"model": msd, "optim": change(osd)}, checkpoint_id=str(path))
    reseal(path)


def test_model_and_optimizer_round_trip_through_the_restricted_reader(tmp_path):
    model, optimizer = trained_model_and_optimizer(3)
    path = tmp_path / ckpt.checkpoint_name(1)
    ckpt.save(path, model, optimizer, tiny_state(1), rank=0)
    assert ckpt.verify(path) is None
    assert isinstance(safe_dcp.CheckedReader(path).read_metadata(), dcp.Metadata)
    items = safe_dcp.read_metadata(path).state_dict_metadata
    assert not [key for key in items if key.startswith("optim.param_groups")], sorted(items)   # states alone

    fresh, fresh_optimizer = tiny_model_and_optimizer(99)
    fresh_optimizer.param_groups[0].update(lr=0.5, weight_decay=0.25)   # a resume with --set train.weight_decay=0.25
    ckpt.load(path, fresh, fresh_optimizer, {"name": "gpt"})
    # The hyperparameters are the resumed run's own (its config): until 2026-11-28 the checkpoint's won, silently.
    assert fresh_optimizer.param_groups[0]["lr"] == 0.5 and fresh_optimizer.param_groups[0]["weight_decay"] == 0.25
    for name, tensor in model.state_dict().items():
        assert torch.equal(fresh.state_dict()[name], tensor), name
    saved, loaded = optimizer.state_dict()["state"], fresh_optimizer.state_dict()["state"]
    assert saved.keys() == loaded.keys() and saved
    for index in saved:
        for key in ("step", "exp_avg", "exp_avg_sq"):
            assert torch.equal(loaded[index][key], saved[index][key]), (index, key)


def test_a_checkpoint_with_the_nested_optimizer_form_still_loads(tmp_path):
    """Checkpoints written before raydl saved the optimizer state flattened (by parameter name)."""
    model, optimizer = trained_model_and_optimizer(3)
    path = tmp_path / ckpt.checkpoint_name(1)
    ckpt.save(path, model, optimizer, tiny_state(1), rank=0)
    msd, osd = get_state_dict(model, optimizer)      # the same files, written in torch's nested form
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=str(path))
    reseal(path)
    assert ckpt.NESTED_KEY in safe_dcp.read_metadata(path).state_dict_metadata
    fresh, fresh_optimizer = tiny_model_and_optimizer(99)
    ckpt.load(path, fresh, fresh_optimizer, {"name": "gpt"})
    saved, loaded = optimizer.state_dict()["state"], fresh_optimizer.state_dict()["state"]
    assert saved.keys() == loaded.keys() and saved
    for index in saved:
        assert torch.equal(loaded[index]["exp_avg"], saved[index]["exp_avg"]), index


def test_a_checkpoint_with_every_parameters_hyperparameters_loads_without_reading_them(tmp_path):
    """The flat form raydl saved before 2026-11-28 (hyperparameters copied to every parameter): its states load,
    its hyperparameters are never read, so a payload there never runs (torch's own reader runs it)."""
    model, optimizer = trained_model_and_optimizer(3)
    marker = tmp_path / "pwned"
    path = tmp_path / ckpt.checkpoint_name(1)

    def payload_as_lr(osd):
        key = next(k for k in osd if k.startswith(ckpt.HYPERPARAMETERS) and k.endswith(".lr"))
        return {**osd, key: TouchOnLoad(marker)}
    save_rewritten(path, model, optimizer, payload_as_lr)
    assert [k for k in safe_dcp.read_metadata(path).state_dict_metadata if k.startswith("optim.param_groups")]
    torch_dcp_load(path, hyperparameters=True)
    assert marker.exists(), "the payload is live: torch's own planner runs it"
    marker.unlink()

    fresh, fresh_optimizer = tiny_model_and_optimizer(99)
    ckpt.load(path, fresh, fresh_optimizer, {"name": "gpt"})
    assert not marker.exists() and fresh_optimizer.param_groups[0]["lr"] == 1e-3
    saved, loaded = optimizer.state_dict()["state"], fresh_optimizer.state_dict()["state"]
    assert saved.keys() == loaded.keys() and saved
    for index in saved:
        for key in ("step", "exp_avg", "exp_avg_sq"):
            assert torch.equal(loaded[index][key], saved[index][key]), (index, key)


def test_metadata_payload_is_refused_naming_file_and_class(tmp_path):
    path, marker = save_step(tmp_path, 5), tmp_path / "pwned"
    forge_metadata(path, marker)
    torch_dcp_load(path)
    assert marker.exists(), "the payload is live: torch's own reader runs it"
    marker.unlink()

    with pytest.raises(CheckpointError, match=rf"{path / '.metadata'}' asks to build pathlib\.Path\.touch"):
        ckpt.load(path, *tiny_model_and_optimizer(0), {"name": "gpt"})
    assert "Path.touch" in ckpt.verify(path)
    assert not marker.exists()


def test_metadata_payload_falls_back_to_the_previous_checkpoint(tmp_path):
    old, new = save_step(tmp_path, 10), save_step(tmp_path, 20)
    marker = tmp_path / "pwned"
    forge_metadata(new, marker)
    with raydl_warns(rf"{new} is not usable .*Path\.touch.*falling back to {old}"):
        assert ckpt.resolve_resume(str(tmp_path)) == old.resolve()
    assert not marker.exists()


def test_optimizer_bytes_payload_is_refused(tmp_path):
    """DCP stores non-tensor entries as torch.save bytes, which torch's planner loads with weights_only=False; raydl's
    loads them as plain data only. A checkpoint whose optimizer step count is such an entry, holding a payload:"""
    model, optimizer = trained_model_and_optimizer(0)
    marker = tmp_path / "pwned"
    path = tmp_path / ckpt.checkpoint_name(1)

    def payload_as_step(osd):
        states = ckpt.optimizer_states(osd)
        key = next(k for k in states if k.endswith(".step"))
        return {**states, key: TouchOnLoad(marker)}
    save_rewritten(path, model, optimizer, payload_as_step)
    torch_dcp_load(path)
    assert marker.exists(), "the payload is live: torch's own planner runs it"
    marker.unlink()

    assert ckpt.verify(path) is None   # well-formed metadata: only loading the entry would run it
    with pytest.raises(CheckpointError, match=rf"checkpoint '{path}' is not usable: its entry .optim\.state\.[\w.]+\.step. asks to build getattr, which is not plain data"):
        ckpt.load(path, *tiny_model_and_optimizer(0), {"name": "gpt"})
    assert not marker.exists()


@pytest.mark.parametrize("relative_path", ["../outside.distcp", "/etc/passwd", "__0_0.distcp/../../x"])
def test_metadata_reading_outside_its_directory_is_refused(tmp_path, relative_path):
    path = save_step(tmp_path, 5)
    with (path / ".metadata").open("rb") as f:
        metadata = pickle.load(f)
    next(iter(metadata.storage_data.values())).relative_path = relative_path
    (path / ".metadata").write_bytes(pickle.dumps(metadata))
    reseal(path)
    with pytest.raises(safe_dcp.UnsafeCheckpoint, match="not a shard file"):
        safe_dcp.read_metadata(path)
    assert "not a shard file" in ckpt.verify(path)


def test_manifest_naming_a_file_outside_the_checkpoint_is_refused(tmp_path):
    path = save_step(tmp_path, 5)
    manifest = path / "files-rank0.json"
    manifest.write_text(json.dumps({**json.loads(manifest.read_text()), "../../secret": [1, "0" * 64]}))
    assert "files-rank0.json lists something other" in ckpt.verify(path)


def test_cli_resume_from_a_crafted_checkpoint_exits_2_before_ray(tmp_path, tiny_overrides, capsys, monkeypatch):
    def no_ray(*args, **kwargs):
        raise AssertionError("Ray was started for a checkpoint that should have been refused")

    monkeypatch.setattr("raydl.driver.ray_trainer.connect", no_ray)
    path, marker = save_step(tmp_path / "old-run", 5), tmp_path / "pwned"
    forge_metadata(path, marker)
    argv = ["train", "--resume", str(path)] + [arg for o in tiny_overrides for arg in ("--set", o)]
    assert cli_main(argv) == 2
    err = capsys.readouterr().err
    assert f"{path / '.metadata'}' asks to build pathlib.Path.touch" in err
    assert "Traceback" not in err
    assert not marker.exists()
    assert not (tmp_path / "runs").exists()   # refused before the run directory was made
