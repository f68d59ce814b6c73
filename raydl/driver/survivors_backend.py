"""Ray Train 2.60's torchft backend (`ray.train.v2.torch.torchft_config`), with torchft's Lighthouse served from
Train's controller process instead of an actor of its own.

Declaring replica groups (`has_replica_groups`) is what makes Train's controller replace a failed worker alone
(`WorkerGroup.replace_replica_group`) instead of restarting the group; each worker is a replica group of one.
Ray's backend starts the Lighthouse as an actor: a new Python process importing ray.train and torchft (~2 CPU-s)
at the very time the workers start and import torch, which on a 2-core machine put 2-3 s on the run's first step,
and with Ray's default of one CPU, one a node whose CPUs the workers hold never has. The Lighthouse is a small
gRPC server in Rust threads of its own that sleep between quorums: the controller, which lives as long as the
run and runs on the driver's node as Ray's actor would, serves it (`on_start` runs there), and it goes with it.
"""

from __future__ import annotations

from ray.train.v2.torch.torchft_config import TorchftConfig, _TorchftBackend


class _RaydlTorchftBackend(_TorchftBackend):
    lighthouse = None   # torchft.coordination.LighthouseServer, once the first worker group starts

    def _maybe_create_lighthouse_actor(self, backend_config: TorchftConfig) -> str:
        if self.lighthouse is None:
            from torchft.coordination import LighthouseServer

            self.lighthouse = LighthouseServer(**{"bind": "[::]:0", **backend_config.lighthouse_kwargs})
        return self.lighthouse.address()


class RaydlTorchftConfig(TorchftConfig):
    @property
    def backend_cls(self):
        return _RaydlTorchftBackend
