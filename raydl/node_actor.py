"""Small named actors that live on this process's node (the driver's): the stop request, the metrics sink."""

from __future__ import annotations


def start_on_this_node(cls, name: str, *args):
    """A named actor of `cls` pinned to this node, so losing a worker node never takes it along, reserving no
    CPU, so it never keeps a worker from being placed. Ray is imported here: torchrun runs without it."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    here = NodeAffinitySchedulingStrategy(node_id=ray.get_runtime_context().get_node_id(), soft=False)
    return ray.remote(num_cpus=0)(cls).options(name=name, scheduling_strategy=here).remote(*args)
