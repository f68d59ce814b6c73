"""raydl_state.json is checked like any other part of a checkpoint: an edited or damaged one makes
the checkpoint unusable, so a run directory falls back to the previous checkpoint with a warning
naming both, and an explicitly named one is a CheckpointError naming the file and the field."""

from __future__ import annotations

import json
import re
import shutil

import pytest

from raydl.errors import CheckpointError
from raydl.train import checkpoint as ckpt
from tests.unit.test_checkpoint_safety import reseal, save_step
from tests.helpers import raydl_warns


def set_field(key, value):
    return lambda state: state.update({key: value})


def set_position(value):
    return lambda state: state["position"].update(value)


# (edit of a valid state, text the complaint must contain)
EDITS = {
    "negative step": (set_field("step", -3), "field 'step' is -3"),
    "string step": (set_field("step", "20"), "field 'step' is \"20\""),
    "float step": (set_field("step", 20.0), "field 'step' is 20.0"),
    "bool step": (set_field("step", True), "field 'step' is true"),
    "missing key": (lambda state: state.pop("samples"), "lacks fields ['samples']"),
    "extra garbage": (set_field("garbage", {"x": 1}), "has unknown fields ['garbage']"),
    "string epoch": (set_position({"epoch": "0"}), "field 'position' is"),
    "float offset": (set_position({"offset": 1.5}), "field 'position' is"),
    "extra position key": (set_position({"shard": 2}), "field 'position' is"),
    "position as list": (set_field("position", [0, 160]), "field 'position' is [0, 160]"),
    "no ranks": (set_field("saved_by_ranks", 0), "field 'saved_by_ranks' is 0"),
    "nan lr": (set_field("lr", float("nan")), "field 'lr' is NaN"),
    "wrong format": (set_field("format", 2), "field 'format' is 2"),
    "scaler as string": (set_field("scaler", "x"), "field 'scaler' is \"x\""),
    "scaler missing a key": (set_field("scaler", {"scale": 1.0}), "field 'scaler' is"),
    "model as string": (set_field("model", "gpt"), "field 'model' is \"gpt\""),
    "not an object": (None, "is list, not a JSON object"),
    "fewer samples than steps": (set_field("samples", 5), "field 'samples' is 5, fewer than its step (20)"),
    "ranks beyond the layout": (set_field("saved_by_ranks", 2), "field 'saved_by_ranks' is 2 but its layout has 1"),
    "the survivors path saved by two": (   # there one replica saves the whole state
        lambda state: state.update(saved_by_ranks=2, layout={**state["layout"], "world_size": 2,
                                                             "dp_wrapper": "torchft"}),
        "field 'saved_by_ranks' is 2 but its layout has 1 saving rank"),
    "ranks whose manifests are missing": (
        lambda state: state.update(saved_by_ranks=2, layout={**state["layout"], "world_size": 2}),
        "missing files-rank1.json"),
}


@pytest.fixture(scope="module")
def saved_run(tmp_path_factory):
    """Checkpoints at steps 10 and 20, saved once for the module: each test edits its own copy."""
    run_dir = tmp_path_factory.mktemp("run")
    save_step(run_dir, 10), save_step(run_dir, 20)
    return run_dir


@pytest.fixture
def run(saved_run, tmp_path):
    """(run directory, its step-10 checkpoint, its step-20 checkpoint)"""
    run_dir = shutil.copytree(saved_run, tmp_path / "run")
    return run_dir, run_dir / "train" / ckpt.checkpoint_name(10), run_dir / "train" / ckpt.checkpoint_name(20)


def edit_state(path, edit) -> None:
    state_file = path / ckpt.STATE_FILE
    state = json.loads(state_file.read_text())
    if edit is None:
        state = [state]
    else:
        edit(state)
    state_file.write_text(json.dumps(state))


@pytest.mark.parametrize("name", EDITS)
def test_edited_state_falls_back_to_the_previous_checkpoint(run, name):
    edit, complaint = EDITS[name]
    run_dir, old, new = run
    edit_state(new, edit)
    assert complaint in ckpt.verify(new)
    with raydl_warns(rf"{new} is not usable \(.*{re.escape(complaint)}.*falling back to {old}"):
        assert ckpt.agree_on_first_valid([str(new), str(old)]) == str(old)
    with raydl_warns(f"{new}.*falling back to {old}"):
        assert ckpt.resolve_resume(str(run_dir)) == old.resolve()


@pytest.mark.parametrize("name", [n for n in EDITS if "manifests" not in n])   # those need the files: verify's
def test_edited_state_named_explicitly_is_a_checkpoint_error(run, name):
    edit, complaint = EDITS[name]
    path = run[2]
    edit_state(path, edit)
    with pytest.raises(CheckpointError, match=re.escape(f"'{path / ckpt.STATE_FILE}' {complaint}")):
        ckpt.read_state(path)
    with pytest.raises(CheckpointError, match=re.escape(f"checkpoint '{path}' is not usable: {ckpt.STATE_FILE} {complaint}")):
        ckpt.resolve_resume(str(path))


def as_if_saved_by_two_ranks(path) -> None:
    """Rename the only shard to rank 1's and split the manifests, as a 2-rank save would have them."""
    (path / "__0_0.distcp").rename(path / "__1_0.distcp")
    metadata = (path / ".metadata").read_bytes()
    (path / ".metadata").write_bytes(metadata.replace(b"__0_0.distcp", b"__1_0.distcp"))
    (path / "files-rank0.json").write_text(json.dumps({".metadata": None}))
    (path / "files-rank1.json").write_text(json.dumps({"__1_0.distcp": None}))
    reseal(path)


def test_lowered_rank_count_cannot_hide_a_shard_from_its_checksum(run):
    """Rank 1's shard is checksummed by files-rank1.json only: a state claiming one saving rank would
    skip that manifest, but .metadata still reads the shard."""
    path = run[2]
    as_if_saved_by_two_ranks(path)
    edit_state(path, lambda state: state.update(saved_by_ranks=2, layout={**state["layout"], "world_size": 2}))
    assert ckpt.verify(path) is None
    edit_state(path, lambda state: state.update(saved_by_ranks=1, layout={**state["layout"], "world_size": 1}))
    assert "reads ['__1_0.distcp'], which no files-rank<r>.json of ranks 0..0 lists" in ckpt.verify(path)


def test_valid_state_is_returned_as_saved(run):
    path = run[2]
    assert ckpt.verify(path) is None
    state = ckpt.read_state(path)
    assert (state["step"], state["samples"], state["position"]) == (20, 160, {"epoch": 0, "offset": 160})


def test_a_survivors_checkpoint_of_two_workers_saved_by_its_leader_resumes(run):
    """On the survivors path (dp_wrapper torchft) the leading replica saves the whole checkpoint of 2 workers."""
    run_dir, _, new = run
    edit_state(new, lambda state: state.update(layout={**state["layout"], "world_size": 2, "dp": 2,
                                                       "dp_wrapper": "torchft"}))
    assert ckpt.verify(new) is None and ckpt.resolve_resume(str(run_dir)) == new.resolve()
