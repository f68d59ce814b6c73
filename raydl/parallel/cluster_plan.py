"""Plan a cluster, not only a layout: step time, wall time and $ of every node type x node count x layout.

    raydl plan --cluster cluster/aws-gpu.yaml --steps 20000 --deadline 12 --budget 100

For each worker node type of a Ray cluster-launcher config (`read_cluster`: its machine must be in
cluster/prices.yaml; a node type that names none, as in local-fake.yaml, is planned as unpriced CPU workers at
this machine's speed), each node count up to its cap, and each dp x pp layout of that many workers that the
planner (`mesh.plan_layouts`) finds fitting, `plan_cluster` predicts the step time and the run's wall time
and $, then names the cheapest plan that meets the deadline and the fastest within the budget. Pure: what was
measured comes from the caller (`Measured`: raydl.parallel.profile_here measures it on the device `raydl plan`
runs on).

The model, and what it assumes until measured on the node type itself
----------------------------------------------------------------------
Compute
    The per-block profile and the optimizer step measured here. On a node of the device they were measured
    on, as they are, divided by the node's ``speed`` (1 unless measured: a worker's speed with all the
    node's workers busy, relative to the lone profiling process; `raydl bench plan_check` measures it for
    this machine). On a GPU every block takes its share of the model's FLOPs at ``GPU_MFU`` of the GPU's
    dense peak at the run's precision (cluster/prices.yaml `tflops`), and at least ``GPU_BLOCK_FLOOR_S``
    forward and twice that backward (kernel launches: small models do not fill a GPU); the optimizer step
    moves ``OPTIMIZER_PASSES`` x the parameter bytes at the GPU's memory bandwidth (AdamW reads parameter,
    gradient and 2 states and writes 3). A precision the GPU lacks (bf16 on a T4) rules the node type out;
    so does a CPU node type for a profile measured on a GPU. The model's FLOPs must be known
    (ModelSpec.flops_per_sample) to move a profile to another device.
Memory
    ``GPU_MEMORY_USABLE`` of the GPU's memory; a CPU node's RAM shared by its workers.
Links (per direction; `Link`)
    Workers of one node: ``INTRA_NODE[machine.gpu_link]`` (``pcie`` without NVLink, as on g5.12xlarge;
    ``nvlink``), ``loopback`` for CPU workers. Between nodes: the machine's ``network_gbps`` (the provider's
    nominal figure, "up to" for small instances) at ``NETWORK_EFFICIENCY``, ``NETWORK_LATENCY_S``.
    Ray packs a pipeline's ranks into one node when pp divides the workers per node; otherwise its stage
    boundaries cross the network. Data parallelism crosses the network as soon as there are 2 nodes.
Step time
    The cost model's (`cost_model.evaluate`: stages, bubble, P2P at the link above), plus the optimizer step
    of the rank holding the most parameters (over dp with fsdp, which shards the states), plus the
    data-parallel traffic of the wrapper `wrapper_policy` chooses, not overlapped with compute (an upper
    bound: DDP and FSDP overlap part of it): ring all-reduce, ``2 (dp-1)/dp x gradient bytes`` per step
    (ddp, replicate); FSDP2 also all-gathers the parameters, forward and backward of every micro-batch without
    a pipeline (``(2m+1) (dp-1)/dp x bytes``), once per step with one (``2 (dp-1)/dp x bytes``). Data
    loading, reports and checkpoint saves are not modelled.
Wall time and $
    ``steps x step time + START_UP_S`` (node boot, image pull, worker start); ``$ = wall hours x (nodes x
    the node's $/h + the head's $/h)``, at the prices of cluster/prices.yaml (spot for spot node types).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from raydl.config import JobConfig
from raydl.errors import ConfigError, LayoutError
from raydl.parallel import schedules
from raydl.parallel.cost_model import Candidate
from raydl.parallel.mesh import min_micro_batch, plan_layouts
from raydl.parallel.profile import BlockProfile, ModelProfile
from raydl.parallel.wrapper_policy import choose_dp_wrapper
from raydl.telemetry.cost import CPU, Accelerator, Node, PriceTable

GPU_MFU = 0.4                 # share of the dense peak a large model reaches on a GPU
GPU_BLOCK_FLOOR_S = 50e-6     # a block's forward on a GPU takes at least this (backward: twice)
GPU_MEMORY_USABLE = 0.9       # CUDA context and allocator slack take the rest
START_UP_S = 300.0            # node boot + image pull + worker start on a cloud (cluster/README.md: minutes)
OPTIMIZER_PASSES = 7          # AdamW: read parameter, gradient, 2 states; write parameter, 2 states


@dataclass(frozen=True)
class Link:
    bytes_per_s: float        # per direction
    latency_s: float


INTRA_NODE = {"pcie": Link(12e9, 10e-6),       # PCIe 4.0 x16 through the host bridge, NCCL's typical bus rate
              "nvlink": Link(150e9, 5e-6),     # NVLink 3 (A100), per direction
              "loopback": Link(1e9, 100e-6)}   # gloo over TCP loopback between CPU processes (profile's default)
NETWORK_EFFICIENCY = 0.8      # TCP/NCCL sockets reach about this share of the line rate
NETWORK_LATENCY_S = 50e-6     # one hop inside a cloud zone


@dataclass(frozen=True)
class Measured:
    """What was measured on one device: the per-block profile, the optimizer step of the whole model, its FLOPs."""

    profile: ModelProfile
    device: str                       # cpu, or a GPU by the price table's name for it
    optimizer_s: float
    flops_per_sample: float | None    # None: unknown, the measurements cannot move to another device


@dataclass(frozen=True)
class NodeType:
    """One kind of worker node a cluster config offers."""

    name: str
    machine: str              # what it is priced as ("g5.2xlarge", "n1-standard-8+nvidia-tesla-t4"), or "-"
    workers: int              # workers per node: its GPUs, or its CPUs / scaling.cpus_per_worker
    max_nodes: int
    spot: bool
    accelerator: Accelerator | None   # None: CPU workers
    memory_bytes: int         # per worker
    intra: Link
    network: Link
    usd_per_hour: float | None        # per node; None: no price known
    start_up_s: float = START_UP_S
    speed: float = 1.0                # a worker's compute speed with all workers busy, relative to the profile

    @property
    def device(self) -> str:
        return self.accelerator.name if self.accelerator else CPU


@dataclass(frozen=True)
class Prediction:
    node_type: NodeType
    nodes: int
    candidate: Candidate
    dp_wrapper: str
    step_s: float             # the cost model's step + optimizer + data-parallel traffic
    optimizer_s: float        # the optimizer step in it
    comm_s: float             # the data-parallel traffic in it
    wall_s: float
    usd: float | None

    @property
    def workers(self) -> int:
        return self.nodes * self.node_type.workers


@dataclass(frozen=True)
class ClusterPlan:
    predictions: list[Prediction]     # the fastest layout of every (node type, node count) that fits, fastest first
    ruled_out: list[str]              # node types that cannot run this model, and why
    cheapest: Prediction | None       # the cheapest within the deadline
    fastest: Prediction | None        # the fastest within the budget
    layouts_evaluated: int


# ---------------------------------------------------------------------------------------------
# Node types of a cluster config


def read_cluster(path: Path, table: PriceTable, cfg: JobConfig, *,
                 host_memory_bytes: int) -> tuple[list[NodeType], float]:
    """(worker node types, the head's $/h: 0 when unpriced) of a Ray cluster-launcher YAML. A CPU node type
    without a listed machine gets `host_memory_bytes` of RAM."""
    data = _read_yaml(path)
    types = data.get("available_node_types")
    if not isinstance(types, dict) or not types:
        raise ConfigError("--cluster", f"'{path}' has no available_node_types, so it is not a Ray cluster-launcher "
                          "config", "pass one like cluster/aws-gpu.yaml (KubeRay manifests name no machine types; "
                          "cluster/gcp-gpu.yaml has the same L4 nodes as cluster/kuberay/*.yaml)")
    cap = int(data.get("max_workers", 2**31))
    head = data.get("head_node_type")
    nodes = {name: _node_type(name, row or {}, table, cfg, cap, where=f"{path}: available_node_types.{name}",
                              host_memory_bytes=host_memory_bytes) for name, row in types.items()}
    head_usd = nodes[head].usd_per_hour if head in nodes else None
    return [t for name, t in nodes.items() if name != head], head_usd or 0.0


def this_machine(workers: int, *, memory_bytes: int, usd_per_hour: float | None, speed: float = 1.0,
                 link: Link = INTRA_NODE["loopback"]) -> NodeType:
    """This machine as one CPU node of `workers` workers, already started (what `raydl bench plan_check` checks),
    with its measured speed and link."""
    return NodeType(name="this machine", machine="-", workers=workers, max_nodes=1, spot=False, accelerator=None,
                    memory_bytes=memory_bytes // workers, intra=link, network=link, usd_per_hour=usd_per_hour,
                    start_up_s=0.0, speed=speed)


def _read_yaml(path: Path) -> dict[str, Any]:
    if not path.is_file():
        raise ConfigError("--cluster", f"'{path}' does not exist", "pass a cluster config, e.g. cluster/aws-gpu.yaml")
    try:
        data = yaml.safe_load(path.read_text())
    except yaml.YAMLError as e:
        raise ConfigError("--cluster", f"'{path}' is not valid YAML ({str(e).splitlines()[0]})", "fix it") from None
    if not isinstance(data, dict):
        raise ConfigError("--cluster", f"'{path}' is not a mapping", "pass a Ray cluster-launcher config")
    return data


def _node_type(name: str, row: dict[str, Any], table: PriceTable, cfg: JobConfig, cap: int, *, where: str,
               host_memory_bytes: int) -> NodeType:
    resources, config = row.get("resources") or {}, row.get("node_config") or {}
    node = _priced_node(config, table, f"{where}.node_config")
    machine = node.machine if node else None
    spot = _is_spot(row, config)
    accelerator = node.accelerator if node and resources.get("GPU") else None
    if accelerator:
        workers, memory = int(resources["GPU"]), int(accelerator.memory_gib * 2**30 * GPU_MEMORY_USABLE)
        intra = INTRA_NODE[machine.gpu_link or "pcie"]
    else:
        workers = int(resources.get("CPU", 0) // cfg.scaling.cpus_per_worker)
        memory = (int(machine.memory_gib * 2**30) if machine else host_memory_bytes) // max(1, workers)
        intra = INTRA_NODE["loopback"]
    # A node the table does not price is a local/fake one (local-fake.yaml): its "network" is this host's loopback.
    network = Link(machine.network_gbps * 1e9 / 8 * NETWORK_EFFICIENCY, NETWORK_LATENCY_S) if machine else intra
    return NodeType(name=name, machine=node.name if node else "-", workers=workers, spot=spot,
                    max_nodes=min(int(row.get("max_workers", cap)), cap), accelerator=accelerator,
                    memory_bytes=memory, intra=intra, network=network,
                    usd_per_hour=node.usd_per_hour(spot) if node else None)


def _priced_node(config: dict[str, Any], table: PriceTable, where: str) -> Node | None:
    """The table's node for an AWS InstanceType or a GCP machineType (+ guestAccelerators); None for neither."""
    if "InstanceType" in config:
        return table.node(config["InstanceType"], field=where)
    if "machineType" not in config:
        return None
    attached = config.get("guestAccelerators") or []
    machine = table.node(config["machineType"], field=where)
    if not attached or machine.machine.gpus:
        return machine
    gpu = attached[0]
    return table.node(f"{config['machineType']}+{int(gpu.get('acceleratorCount', 1))}x{gpu['acceleratorType']}",
                      field=where)


def _is_spot(row: dict[str, Any], config: dict[str, Any]) -> bool:
    market = (config.get("InstanceMarketOptions") or {}).get("MarketType", "")
    provisioning = (config.get("scheduling") or {}).get("provisioningModel", "")
    label = (row.get("labels") or {}).get("ray.io/market-type", "")
    return "spot" in {str(market).lower(), str(provisioning).lower(), str(label).lower()}


# ---------------------------------------------------------------------------------------------
# The measurements on another device


def on_device(measured: Measured, node_type: NodeType, *, precision: str) -> Measured:
    """The measurements as one of the node type's workers would make them (LayoutError: they cannot move there)."""
    profile = measured.profile
    if node_type.device == measured.device:
        slower = 1 / node_type.speed
        blocks = tuple(dataclasses.replace(b, fwd_s=b.fwd_s * slower, bwd_s=b.bwd_s * slower) for b in profile.blocks)
        return dataclasses.replace(measured, profile=dataclasses.replace(profile, blocks=blocks),
                                   optimizer_s=measured.optimizer_s * slower)
    gpu = node_type.accelerator
    if gpu is None:
        raise LayoutError(f"its workers are CPUs and the profile was measured on {measured.device}: profile on a CPU")
    if precision not in gpu.tflops:
        raise LayoutError(f"{gpu.name} has no {precision} (it has {', '.join(gpu.tflops)}): set train.precision "
                          f"to one of those")
    if not measured.flops_per_sample:
        raise LayoutError("the model's FLOPs are unknown (ModelSpec.flops_per_sample), so the profile measured on "
                          f"{measured.device} cannot be moved to a {gpu.name}: plan on that GPU")
    total = sum(b.fwd_s + b.bwd_s for b in profile.blocks)
    scale = measured.flops_per_sample * profile.micro_batch / (gpu.tflops[precision] * 1e12 * GPU_MFU) / total
    blocks = tuple(_on_gpu(b, scale) for b in profile.blocks)
    optimizer_s = OPTIMIZER_PASSES * sum(b.param_bytes for b in profile.blocks) / (gpu.memory_gb_per_s * 1e9)
    return dataclasses.replace(measured, profile=dataclasses.replace(profile, blocks=blocks), device=gpu.name,
                               optimizer_s=optimizer_s)


def _on_gpu(block: BlockProfile, scale: float) -> BlockProfile:
    return dataclasses.replace(block, fwd_s=max(block.fwd_s * scale, GPU_BLOCK_FLOOR_S),
                               bwd_s=max(block.bwd_s * scale, 2 * GPU_BLOCK_FLOOR_S))


def with_link(profile: ModelProfile, link: Link) -> ModelProfile:
    return dataclasses.replace(profile, p2p_bytes_per_s=link.bytes_per_s, p2p_latency_s=link.latency_s)


# ---------------------------------------------------------------------------------------------
# Predictions


def predict(measured: Measured, cfg: JobConfig, node_type: NodeType, nodes: int, *,
            steps: int, head_usd_per_hour: float = 0.0) -> tuple[Prediction, int]:
    """The fastest fitting layout of `nodes` nodes of this type, and how many layouts were evaluated.
    `measured` is on the node type's device already (`on_device`). LayoutError when none fits."""
    world = nodes * node_type.workers
    inside = with_link(measured.profile, node_type.intra)
    across = inside if nodes == 1 else with_link(measured.profile, node_type.network)
    candidates = [c for c in _usable(inside, cfg, world, node_type) if _in_one_node(c.pp, node_type)]
    candidates += [c for c in _usable(across, cfg, world, node_type) if not _in_one_node(c.pp, node_type)]
    if not candidates:
        raise LayoutError(f"no layout of {world} workers fits")
    dp_link = node_type.intra if nodes == 1 else node_type.network
    timed = [_timed(measured, cfg, c, node_type, dp_link) for c in candidates]
    step_s, optimizer_s, comm_s, candidate, wrapper = min(timed, key=lambda x: x[0])
    wall_s = steps * step_s + node_type.start_up_s
    usd = None if node_type.usd_per_hour is None else \
        wall_s / 3600 * (nodes * node_type.usd_per_hour + head_usd_per_hour)
    return Prediction(node_type, nodes, candidate, wrapper, step_s, optimizer_s, comm_s, wall_s, usd), len(candidates)


def _in_one_node(pp: int, node_type: NodeType) -> bool:
    return node_type.workers % pp == 0


def _usable(profile: ModelProfile, cfg: JobConfig, world: int, node_type: NodeType) -> list[Candidate]:
    try:
        _, candidates = plan_layouts(profile, cfg, world_size=world, memory_bytes=node_type.memory_bytes)
    except LayoutError:
        return []
    return [c for c in candidates if c.fits and c.micro_batch >= min_micro_batch(cfg)]


def _timed(measured: Measured, cfg: JobConfig, candidate: Candidate, node_type: NodeType,
           link: Link) -> tuple[float, float, float, Candidate, str]:
    """(step, optimizer, data-parallel traffic, candidate, wrapper) of one candidate."""
    profile = measured.profile
    model_bytes = sum(b.param_bytes for b in profile.blocks)
    wrapper, _ = choose_dp_wrapper(cfg.parallel.dp_wrapper, dp=candidate.dp, pp=candidate.pp,
                                   param_bytes=model_bytes, memory_bytes=node_type.memory_bytes,
                                   in_backward=cfg.train.optimizer_in_backward)
    sharded_over = candidate.dp if wrapper == "fsdp" else 1
    optimizer_s = measured.optimizer_s * rank_param_bytes(candidate, profile) / model_bytes / sharded_over
    comm_s = dp_traffic_s(candidate, profile, wrapper, link)
    return candidate.predicted_step_s + optimizer_s + comm_s, optimizer_s, comm_s, candidate, wrapper


def rank_param_bytes(candidate: Candidate, profile: ModelProfile) -> int:
    """Parameter bytes of the pipeline rank holding the most."""
    per_rank = [0] * candidate.pp
    for rank, stage in zip(schedules.stage_ranks(candidate.schedule, candidate.pp), candidate.stages):
        per_rank[rank] += sum(b.param_bytes for b in profile.blocks[stage.blocks[0]:stage.blocks[1]])
    return max(per_rank)


def dp_traffic_s(candidate: Candidate, profile: ModelProfile, wrapper: str, link: Link) -> float:
    """Seconds per step of data-parallel collectives on the rank holding the most parameters."""
    dp = candidate.dp
    if dp == 1:
        return 0.0
    if wrapper in ("ddp", "replicate") or candidate.pp > 1:
        rounds = 2
    else:                                   # FSDP2 without a pipeline reshards after every forward
        rounds = 2 * candidate.num_microbatches + 1
    share = (dp - 1) / dp * rank_param_bytes(candidate, profile)
    return rounds * share / link.bytes_per_s + rounds * (dp - 1) * link.latency_s


def plan_cluster(measured: Measured, cfg: JobConfig, node_types: list[NodeType], *, steps: int,
                 head_usd_per_hour: float = 0.0, deadline_s: float | None = None,
                 budget_usd: float | None = None) -> ClusterPlan:
    predictions, ruled_out, evaluated = [], [], 0
    for node_type in node_types:
        try:
            there = on_device(measured, node_type, precision=cfg.train.precision)
        except LayoutError as why:
            ruled_out.append(f"{node_type.name}: {why}")
            continue
        fitting = 0
        for nodes in range(1, node_type.max_nodes + 1):
            try:
                prediction, count = predict(there, cfg, node_type, nodes, steps=steps,
                                            head_usd_per_hour=head_usd_per_hour)
            except LayoutError:
                continue
            predictions.append(prediction)
            evaluated, fitting = evaluated + count, fitting + 1
        if not fitting:
            ruled_out.append(f"{node_type.name}: no layout fits on 1..{node_type.max_nodes} nodes of "
                             f"{node_type.workers} workers")
    predictions.sort(key=lambda p: p.wall_s)
    return ClusterPlan(predictions, ruled_out, _cheapest(predictions, deadline_s), _fastest(predictions, budget_usd),
                       evaluated)


def _cheapest(predictions: list[Prediction], deadline_s: float | None) -> Prediction | None:
    within = [p for p in predictions if p.usd is not None and (deadline_s is None or p.wall_s <= deadline_s)]
    return min(within, key=lambda p: (p.usd, p.wall_s), default=None)


def _fastest(predictions: list[Prediction], budget_usd: float | None) -> Prediction | None:
    within = [p for p in predictions if budget_usd is None or (p.usd is not None and p.usd <= budget_usd)]
    return min(within, key=lambda p: (p.wall_s, p.usd or 0.0), default=None)
