"""Checkpoints in a bucket (moto's S3 server): an upload cut off is never taken for a checkpoint, even though
raydl_state.json and .metadata made it (an object store has no rename, and Ray uploads a checkpoint's files
in no set order); the newest intact one is found, verified and loaded from its URI."""

from __future__ import annotations

import pytest
import torch

from raydl import storage
from raydl.errors import CheckpointError
from raydl.models.gpt import build_gpt
from raydl.train import checkpoint as ckpt
from tests.helpers import raydl_warns
from tests.unit.test_checkpoint_safety import save_step, tiny_state


def upload(local, uri: str, *, skip: str | None = None) -> None:
    """`local` copied to `uri` file by file, as Ray uploads it; `skip`: a file whose upload never happened."""
    fs, path = storage.resolve(uri, "test")
    for f in sorted(local.iterdir()):
        if f.name != skip:
            storage.write_bytes(fs, f"{path}/{f.name}", f.read_bytes())


@pytest.mark.slow   # moto's S3 server, a process
def test_an_upload_cut_off_falls_back_to_the_previous_checkpoint(s3_bucket, tmp_path):
    runs = f"{s3_bucket}/ckpt/run-1"
    old, new = save_step(tmp_path, 10), save_step(tmp_path, 20)
    upload(old, f"{runs}/step_00000010")
    upload(new, f"{runs}/step_00000020", skip=next(new.glob("__0_*.distcp")).name)
    assert ckpt.is_complete(f"{runs}/step_00000020")            # the files written last are there...
    assert ckpt.all_complete(runs) == [f"{runs}/step_00000020", f"{runs}/step_00000010"]
    with raydl_warns("step_00000020 is not usable .*distcp is missing"):
        assert ckpt.resolve_resume(runs) == f"{runs}/step_00000010"   # ...but it is not intact: never loaded
    with pytest.raises(CheckpointError, match="step_00000020' is not usable"):
        ckpt.resolve_resume(f"{runs}/step_00000020")


@pytest.mark.slow   # moto's S3 server, a process
def test_a_checkpoint_uri_loads_the_weights_it_holds(s3_bucket, tmp_path):
    saved = save_step(tmp_path, 10)
    uri = f"{s3_bucket}/ckpt/step_00000010"
    upload(saved, uri)
    torch.manual_seed(10)
    expected = build_gpt("tiny", vocab_size=16, seq_len=8).state_dict()
    torch.manual_seed(99)
    model = build_gpt("tiny", vocab_size=16, seq_len=8)
    state = ckpt.load(uri, model, torch.optim.AdamW(model.parameters()), {"name": "gpt"})
    assert state["step"] == tiny_state(10)["step"]
    for name, tensor in model.state_dict().items():
        torch.testing.assert_close(tensor, expected[name])


@pytest.mark.slow   # moto's S3 server, a process
def test_resume_from_a_missing_checkpoint_uri_is_one_paragraph(s3_bucket):
    with pytest.raises(CheckpointError, match="--resume path 's3://.*/nothing' does not exist"):
        ckpt.resolve_resume(f"{s3_bucket}/nothing")
    with pytest.raises(storage.StorageError, match="--resume 's3://no-such-bucket/run' names the bucket"):
        ckpt.resolve_resume("s3://no-such-bucket/run")
