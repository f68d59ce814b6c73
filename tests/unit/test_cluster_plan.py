"""raydl plan --cluster: node types read from the real cluster configs and priced from cluster/prices.yaml, the
profile moved to a GPU, data-parallel traffic, the cheapest plan within a deadline and the fastest within a budget
(hand computations on a hand-made profile), and the CLI end to end."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from raydl.cli import main
from raydl.errors import ConfigError, LayoutError
from raydl.overrides import load_config
from raydl.parallel import cluster_plan as cp
from raydl.parallel.cost_model import evaluate
from raydl.parallel.profile import BlockProfile, ModelProfile
from raydl.telemetry.cost import TABLE_PATH, PriceTable

CLUSTER = Path(__file__).resolve().parents[2] / "cluster"
TABLE = yaml.safe_load(TABLE_PATH.read_text())
MACHINES = TABLE["machines"]
MIB = 2**20


def profile(fwd_ms: float = 10.0, blocks: int = 4, param_mib: int = 8) -> ModelProfile:
    return ModelProfile(blocks=tuple(BlockProfile(f"b{i}", fwd_ms / 1e3, 2 * fwd_ms / 1e3, param_mib * MIB, MIB,
                                                  MIB // 4) for i in range(blocks)), micro_batch=32)


def cfg(*sets: str):
    return load_config(None, ["parallel.pp_degree=auto", "train.global_batch_size=64", "train.micro_batch_size=32",
                              *sets])


def node_types(name: str, *sets: str):
    return cp.read_cluster(CLUSTER / name, PriceTable.load(), cfg(*sets), host_memory_bytes=16 * 2**30)


def test_aws_node_types_are_the_configs_with_the_tables_prices():
    types, head_usd = node_types("aws-gpu.yaml")
    got = {t.name: (t.machine, t.workers, t.max_nodes, t.spot, t.device, t.usd_per_hour) for t in types}
    assert got == {
        "ray.worker.gpu": ("g5.2xlarge", 1, 4, False, "A10G", MACHINES["g5.2xlarge"]["on_demand"]),
        "ray.worker.gpu_spot": ("g5.2xlarge", 1, 4, True, "A10G", MACHINES["g5.2xlarge"]["spot"]),
        "ray.worker.gpu_4x": ("g5.12xlarge", 4, 2, False, "A10G", MACHINES["g5.12xlarge"]["on_demand"])}
    assert head_usd == MACHINES["m5.2xlarge"]["on_demand"]
    four = next(t for t in types if t.name == "ray.worker.gpu_4x")
    assert four.intra == cp.INTRA_NODE["pcie"]
    assert four.network.bytes_per_s == pytest.approx(40e9 / 8 * cp.NETWORK_EFFICIENCY)
    assert four.memory_bytes == int(24 * 2**30 * cp.GPU_MEMORY_USABLE)


def test_gcp_t4_nodes_cost_the_machine_plus_the_attached_gpu():
    types, _ = node_types("gcp-gpu.yaml")
    t4 = next(t for t in types if t.name == "ray_worker_t4_spot")
    assert t4.machine == "n1-standard-8+nvidia-tesla-t4" and t4.spot and t4.device == "T4"
    t4_attached = TABLE["accelerators"]["T4"]["attach"]["spot"]
    assert t4.usd_per_hour == pytest.approx(MACHINES["n1-standard-8"]["spot"] + t4_attached)
    l4 = next(t for t in types if t.name == "ray_worker_l4")
    assert (l4.machine, l4.usd_per_hour) == ("g2-standard-8", MACHINES["g2-standard-8"]["on_demand"])


def test_a_kuberay_manifest_or_a_missing_file_is_refused():
    with pytest.raises(ConfigError, match="no available_node_types"):
        node_types("kuberay/raycluster-gpu.yaml")
    with pytest.raises(ConfigError, match="does not exist"):
        node_types("nowhere.yaml")


def measured(device: str = "cpu", *, fwd_ms: float = 10.0, optimizer_ms: float = 0.0,
             flops_per_sample: float | None = 1e12) -> cp.Measured:
    return cp.Measured(profile=profile(fwd_ms=fwd_ms), device=device, optimizer_s=optimizer_ms / 1e3,
                       flops_per_sample=flops_per_sample)


def test_cpu_measurements_move_to_a_gpu_by_the_models_flops_and_the_gpus_memory_bandwidth():
    (a10g, *_), _ = node_types("aws-gpu.yaml")
    here = measured(fwd_ms=10.0, optimizer_ms=30.0)         # 4 blocks x (10 + 20) ms = 0.12 s per micro-batch
    moved = cp.on_device(here, a10g, precision="bf16")
    gpu = TABLE["accelerators"]["A10G"]
    assert sum(b.fwd_s + b.bwd_s for b in moved.profile.blocks) == pytest.approx(
        1e12 * 32 / (gpu["tflops"]["bf16"] * 1e12 * cp.GPU_MFU))
    assert moved.profile.blocks[0].bwd_s == pytest.approx(2 * moved.profile.blocks[0].fwd_s)
    assert moved.optimizer_s == pytest.approx(cp.OPTIMIZER_PASSES * 32 * MIB / (gpu["memory_gb_per_s"] * 1e9))
    tiny = cp.on_device(measured(flops_per_sample=1e6), a10g, precision="fp32")
    assert {(b.fwd_s, b.bwd_s) for b in tiny.profile.blocks} == {(cp.GPU_BLOCK_FLOOR_S, 2 * cp.GPU_BLOCK_FLOOR_S)}
    assert cp.on_device(measured("A10G", flops_per_sample=None), a10g, precision="bf16").profile == here.profile


def test_a_node_measured_slower_slows_its_workers_down():
    busy = cp.this_machine(2, memory_bytes=2**34, usd_per_hour=None, speed=0.5)
    slowed = cp.on_device(measured(fwd_ms=10.0, optimizer_ms=4.0), busy, precision="fp32")
    assert slowed.profile.blocks[0].fwd_s == pytest.approx(0.02) and slowed.optimizer_s == pytest.approx(0.008)


@pytest.mark.parametrize("precision, flops, message", [("bf16", 1e9, "T4 has no bf16"),
                                                       ("fp16", None, "FLOPs are unknown")])
def test_what_cannot_move_to_a_gpu_says_why(precision, flops, message):
    types, _ = node_types("gcp-gpu.yaml")
    t4 = next(t for t in types if t.device == "T4")
    with pytest.raises(LayoutError, match=message):
        cp.on_device(measured(flops_per_sample=flops), t4, precision=precision)
    with pytest.raises(LayoutError, match="profile on a CPU"):
        cp.on_device(measured("T4"), cp.this_machine(1, memory_bytes=2**34, usd_per_hour=None), precision="fp32")


def test_data_parallel_traffic_per_wrapper():
    link = cp.Link(1e9, 1e-4)
    here = profile(param_mib=8)                              # 32 MiB of parameters, all on the one stage
    c = evaluate(here, world_size=4, pp=1, schedule="1f1b", global_batch=64, device_memory_bytes=2**40,
                 num_microbatches=2)
    ring = 3 / 4 * 32 * MIB / 1e9
    assert cp.dp_traffic_s(c, here, "ddp", link) == pytest.approx(2 * ring + 2 * 3 * 1e-4)
    assert cp.dp_traffic_s(c, here, "fsdp", link) == pytest.approx(5 * ring + 5 * 3 * 1e-4)   # (2m + 1) rounds
    piped = evaluate(here, world_size=4, pp=2, schedule="1f1b", global_batch=64, device_memory_bytes=2**40,
                     num_microbatches=2)
    assert cp.dp_traffic_s(piped, here, "fsdp", link) == pytest.approx(2 * (1 / 2) * 16 * MIB / 1e9 + 2 * 1e-4)


def test_cheapest_within_the_deadline_and_fastest_within_the_budget():
    types, head_usd = node_types("aws-gpu.yaml")
    steps, plan_cfg = 100_000, cfg("parallel.pp_degree=1")

    def plan(**limits):
        return cp.plan_cluster(measured("A10G", fwd_ms=40.0, optimizer_ms=20.0), plan_cfg, types, steps=steps,
                               head_usd_per_hour=head_usd, **limits)

    everything = plan()
    spot = {p.nodes: p for p in everything.predictions if p.node_type.name == "ray.worker.gpu_spot"}
    # 1 worker: 2 micro-batches of 32 through 4 blocks of 40 + 80 ms, and the optimizer step
    assert spot[1].step_s == pytest.approx(0.96 + 0.02)
    assert spot[1].wall_s == pytest.approx(steps * 0.98 + cp.START_UP_S)
    assert spot[1].usd == pytest.approx(spot[1].wall_s / 3600 * (MACHINES["g5.2xlarge"]["spot"] + head_usd))
    # 4 nodes: a quarter of the compute, the whole optimizer step, DDP's ring all-reduce of 32 MiB over 10 Gbps
    ring = 2 * 3 / 4 * 32 * MIB / (10e9 / 8 * cp.NETWORK_EFFICIENCY) + 2 * 3 * cp.NETWORK_LATENCY_S
    assert spot[4].comm_s == pytest.approx(ring) and spot[4].step_s == pytest.approx(0.24 + 0.02 + ring)
    assert everything.cheapest.usd == min(p.usd for p in everything.predictions)
    assert everything.fastest.wall_s == min(p.wall_s for p in everything.predictions)
    deadline, budget = spot[2].wall_s, spot[1].usd
    limited = plan(deadline_s=deadline, budget_usd=budget)
    assert limited.cheapest.usd == min(p.usd for p in limited.predictions if p.wall_s <= deadline)
    assert limited.fastest.wall_s == min(p.wall_s for p in limited.predictions if p.usd <= budget)
    assert limited.fastest.usd <= budget < max(p.usd for p in limited.predictions)   # the budget ruled some out
    assert plan(budget_usd=0.01).fastest is None


def test_plan_cluster_cli_names_the_cheapest_and_the_fastest(data_cache, capsys):
    code = main(["plan", "--cluster", str(CLUSTER / "gcp-gpu.yaml"), "--steps", "1000", "--deadline", "10",
                 "--budget", "50", "--set", f"data.cache_dir={data_cache}", "--set", "data.builtin_samples=1024",
                 "--set", "train.precision=bf16"])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "c = cheapest within the deadline (10 h): " in out and "f = fastest within the budget ($50): " in out
    assert "ruled out: ray_worker_t4: T4 has no bf16" in out and "g2-standard-8" in out


@pytest.mark.parametrize("argv, message", [
    (["--workers", "2", "--cluster", "cluster/aws-gpu.yaml"], "give exactly one"),
    (["--workers", "2", "--steps", "10"], "--steps' only applies with --cluster"),
    (["--cluster", "cluster/aws-gpu.yaml", "--deadline", "0"], "--deadline' is 0"),
])
def test_plan_cli_refuses_bad_arguments(argv, message, capsys):
    assert main(["plan", *argv]) == 2
    assert message in capsys.readouterr().err
