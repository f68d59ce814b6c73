"""The state holder keeps a shard after its sender is SIGKILLed: Ray frees the objects a dead worker owned, so
the holder must hold copies of its own (raydl/train/state_holder.py), not views of the sender's buffers.

Both actors run with Ray's zero-copy tensor transport on (RAY_ENABLE_ZERO_COPY_TORCH_TENSORS=1, off by default),
under which what the holder receives is a view of the object store's memory."""

from __future__ import annotations

import os
import signal
import uuid

import pytest
import torch

from raydl.train.state_holder import StateHolder

ONE_RANK = {"world_size": 1, "dp": 1, "pp": 1}
ZERO_COPY = {"env_vars": {"RAY_ENABLE_ZERO_COPY_TORCH_TENSORS": "1"}}
N = 1 << 20   # 4 MB of float32: big enough to travel through Ray's shared-memory object store


class Sender:
    def pid(self) -> int:
        return os.getpid()

    def send(self, holder, generation: int) -> bool:
        import ray

        shard = {"model": {"w": torch.arange(N, dtype=torch.float32)}, "trainer": {"step": 1}}
        return ray.get(holder.put.remote(generation, 0, 1, ONE_RANK, shard))


@pytest.mark.slow
def test_held_shard_survives_a_sigkill_of_its_sender(ray_session):
    ray = ray_session
    holder = ray.remote(num_cpus=0)(StateHolder).options(name=f"test-holder-{uuid.uuid4().hex[:8]}",
                                                         runtime_env=ZERO_COPY).remote()
    generation = ray.get(holder.begin_group.remote(ONE_RANK))["generation"]
    sender = ray.remote(num_cpus=0)(Sender).options(runtime_env=ZERO_COPY).remote()
    assert ray.get(sender.send.remote(holder, generation))
    os.kill(ray.get(sender.pid.remote()), signal.SIGKILL)
    with pytest.raises(ray.exceptions.RayActorError):
        ray.get(sender.pid.remote(), timeout=60)
    for _ in range(8):   # reuse the object store's memory that the dead sender's objects took
        ray.get(ray.put(torch.zeros(N).numpy()))

    # In the holder's own heap: a tensor torch allocated there can be resized, a view of a received buffer cannot
    # (asked before anything reads the tensors back: sending one out with zero-copy makes it unresizable too).
    assert ray.get(holder.__ray_call__.remote(
        lambda h: [t.untyped_storage().resizable() for e in h.entries.values() for t in e["ranks"][0]["model"].values()]
    )) == [True]

    answer = ray.get(holder.begin_group.remote(ONE_RANK))
    assert answer["step"] == 1
    held = ray.get(holder.get.remote(answer["source_generation"], 1, 0))
    assert torch.equal(held["model"]["w"], torch.arange(N, dtype=torch.float32))
    assert ray.get(holder.held.remote())["bytes"] == 4 * N
    ray.kill(holder)
