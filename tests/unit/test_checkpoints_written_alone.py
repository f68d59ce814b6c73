"""The survivors path's checkpoints written by the leading replica alone while the group is smaller are not in
Ray's registry: a restart of the group must still find them when they are newer than Ray's newest, and skip the
ones Ray registered or that are older (raydl.train.session.RaySession.latest_checkpoint)."""

from __future__ import annotations

from types import SimpleNamespace

from raydl.train import checkpoint as ckpt
from raydl.train.session import RaySession
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


class _Registry:
    """Ray's checkpoint registry as a worker reads it (ray.train.get_all_reported_checkpoints): the rare branch of
    a report Ray discarded at a worker's replacement cannot be timed in a real run."""

    def __init__(self, paths):
        self.paths = paths

    def get_all_reported_checkpoints(self, timeout_s=None):
        return [SimpleNamespace(checkpoint=SimpleNamespace(path=str(p))) for p in self.paths]


def _leader(checkpoints_at, registry) -> RaySession:
    session = object.__new__(RaySession)   # no Ray: only the retention state is used
    session.checkpoints_at, session.keep, session._train = str(checkpoints_at), 2, registry
    session.leader, session.alone, session.unconfirmed, session.last_reported = True, [], [], None
    return session


def test_a_report_ray_never_registered_is_removed_once_a_newer_one_is(tmp_path):
    paths = {step: save_step(tmp_path, step) for step in (5, 10, 15, 20)}
    session = _leader(tmp_path / "train", _Registry([paths[5], paths[10]]))
    session.unconfirmed = [ckpt.checkpoint_name(15)]   # reported through Ray when the peer was lost
    session._remove_unregistered(ckpt.checkpoint_name(20))   # Ray has not registered step 20 yet: wait
    assert paths[15].exists() and session.unconfirmed == [ckpt.checkpoint_name(15)]
    session._train = _Registry([paths[10], paths[20]])
    session._remove_unregistered(ckpt.checkpoint_name(20))
    assert not paths[15].exists() and session.unconfirmed == []
    assert paths[5].exists() and paths[10].exists() and paths[20].exists()   # Ray's to keep or delete
