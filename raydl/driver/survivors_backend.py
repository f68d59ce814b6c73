"""Ray Train 2.60's torchft backend (`ray.train.v2.torch.torchft_config`), with its Lighthouse actor taking no CPU.

Declaring replica groups (`has_replica_groups`) is what makes Train's controller replace a failed worker alone
(`WorkerGroup.replace_replica_group`) instead of restarting the group; each worker is a replica group of one.
Ray's backend starts torchft's Lighthouse as an actor pinned to the controller's node with Ray's default of one
CPU to place an actor: on a node whose CPUs the workers hold (raydl's fault cluster: a 1-CPU head) it is never
placed and the group never starts. It is a small gRPC server that sleeps between quorums: zero CPUs here.
"""

from __future__ import annotations

import ray
from ray.train.v2.torch.torchft_config import LighthouseServerActor, TorchftConfig, _TorchftBackend
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy


class _RaydlTorchftBackend(_TorchftBackend):
    def _maybe_create_lighthouse_actor(self, backend_config: TorchftConfig) -> str:
        if self.lighthouse_actor is None:
            node = NodeAffinitySchedulingStrategy(node_id=ray.get_runtime_context().get_node_id(), soft=False)
            kwargs = {"bind": "[::]:0", **backend_config.lighthouse_kwargs}
            self.lighthouse_actor = LighthouseServerActor.options(num_cpus=0, scheduling_strategy=node).remote(
                lighthouse_kwargs=kwargs)
        return super()._maybe_create_lighthouse_actor(backend_config)   # its address, once it answers


class RaydlTorchftConfig(TorchftConfig):
    @property
    def backend_cls(self):
        return _RaydlTorchftBackend
