"""The survivors path's checkpoints written by the leading replica alone while the group is smaller are not in
Ray's registry: a restart of the group must still find them when they are newer than Ray's newest, and skip the
ones Ray registered or that are older (raydl.train.session.RaySession.latest_checkpoint)."""

from __future__ import annotations

from raydl.train import checkpoint as ckpt
from tests.unit.test_checkpoint_safety import save_step


def test_step_of_reads_plain_and_redone_names():
    assert ckpt.step_of("/runs/a/train/step_00000095") == 95
    assert ckpt.step_of("s3://bucket/run-1/step_00000100.2/") == 100


def test_only_unregistered_checkpoints_newer_than_rays_newest_are_taken(tmp_path):
    for step in (5, 10, 15, 20, 25):
        save_step(tmp_path, step)
    (tmp_path / "train" / "step_00000030").mkdir()   # incomplete: a write cut off, never a candidate
    listed = ckpt.all_complete(tmp_path)
    registered = {ckpt.checkpoint_name(5), ckpt.checkpoint_name(10)}
    alone = ckpt.newer_than_registered(listed, registered, newest_registered=10)
    assert [ckpt.step_of(c) for c in alone] == [25, 20, 15]   # newest first, as the candidates are tried
    assert ckpt.newer_than_registered(listed, registered | {ckpt.checkpoint_name(20)}, newest_registered=20) == \
        [listed[0]]
    assert [ckpt.step_of(c) for c in ckpt.newer_than_registered(listed, set(), None)] == [25, 20, 15, 10, 5]
    assert ckpt.first_valid([str(c) for c in alone]) == str(listed[0])
