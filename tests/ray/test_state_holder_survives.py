"""The state holder keeps a shard after its sender is SIGKILLed: Ray frees the objects a dead worker owned, so
the holder must hold copies of its own (raydl/train/state_holder.py), not views of the sender's buffers."""

from __future__ import annotations

import os
import signal
import uuid

import pytest
import torch

from raydl.node_actor import start_on_this_node
from raydl.train.state_holder import StateHolder

ONE_RANK = {"world_size": 1, "dp": 1, "pp": 1}
N = 1 << 20   # 4 MB of float32: big enough to travel through Ray's shared-memory object store


class Sender:
    def pid(self) -> int:
        return os.getpid()

    def send(self, holder, generation: int) -> bool:
        import ray

        shard = {"model": {"w": torch.arange(N, dtype=torch.float32)}, "trainer": {"step": 1}}
        return ray.get(holder.put.remote(generation, 0, 1, ONE_RANK, shard))


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_held_shard_survives_a_sigkill_of_its_sender(ray_session):
    ray = ray_session
    holder = start_on_this_node(StateHolder, f"test-holder-{uuid.uuid4().hex[:8]}")
    generation = ray.get(holder.begin_group.remote(ONE_RANK))["generation"]
    sender = ray.remote(num_cpus=0)(Sender).remote()
    assert ray.get(sender.send.remote(holder, generation))
    os.kill(ray.get(sender.pid.remote()), signal.SIGKILL)
    with pytest.raises(ray.exceptions.RayActorError):
        ray.get(sender.pid.remote(), timeout=60)
    for _ in range(8):   # reuse the object store's memory that the dead sender's objects took
        ray.get(ray.put(torch.zeros(N)))

    answer = ray.get(holder.begin_group.remote(ONE_RANK))
    assert answer["step"] == 1
    held = ray.get(holder.get.remote(answer["source_generation"], 1, 0))
    assert torch.equal(held["model"]["w"], torch.arange(N, dtype=torch.float32))
    assert ray.get(holder.held.remote())["bytes"] == 4 * N
    ray.kill(holder)
