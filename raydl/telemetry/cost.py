"""What a run costs: device-hours counted as the run goes, priced from cluster/prices.yaml.

Accounting (`CostMeter`, on the driver: the metrics writer feeds it every step record it writes)
    A step holds ``world_size x units`` devices for its ``elapsed_s``: units are GPUs per worker
    (scaling.gpus_per_worker) on a GPU run, CPU cores per worker (scaling.cpus_per_worker) on a CPU run.
    ``elapsed_s`` runs from the end of the worker group's previous step, so the evaluations, checkpoint saves
    and reports between steps are in it. The gap before a new worker group's first step (a restart or a
    resize: old group down, new workers up, checkpoint loaded) is charged at the smaller of the two group
    sizes, the devices held on both sides of it. Steps redone after a restart are charged again: they were
    paid for twice. Not counted: start-up before the run's first step, the final evaluation, node boot and
    idle timeout, the head node. Every metrics.jsonl line carries the run's running totals
    (``device_hours``, ``cost_usd``); summary.json has the totals and how they were priced.
Pricing (`Pricing.rate`, per device the workers report)
    cost.instance_type names the machine: its price per hour (cost.prices[name], or the table's on-demand
    or spot price by cost.spot) split over its GPUs, or its vCPUs on a CPU run. Without it a GPU run is
    priced per GPU-hour by the GPU's name: cost.prices[<any name of it>], else its cheapest listed machine
    per GPU; a CPU run per core-hour only at cost.prices.cpu_core: a CPU run on no named machine is taken
    to be on a machine nobody rents by the hour (a laptop, a workstation), so no price applies to it.
    Without a price (that, or a GPU the table does not know) the $ is unknown (None) with the reason, and
    only device-hours are counted and shown.
"""

from __future__ import annotations

import functools
import json
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from raydl.config import CostSection, JobConfig, ScalingSection
from raydl.errors import ConfigError
from raydl.telemetry.records import StepRecord

TABLE_PATH = Path(__file__).resolve().parents[2] / "cluster" / "prices.yaml"
CPU = "cpu"   # the device name of a CPU worker
_NODE = re.compile(r"^(?P<machine>[^+\s]+)(?:\+(?:(?P<count>\d+)x)?(?P<accelerator>\S+))?$")


@dataclass(frozen=True)
class Price:
    """$ per hour on demand and on spot, and where that came from."""

    on_demand: float
    spot: float
    date: str
    source: str

    def at(self, spot: bool) -> float:
        return self.spot if spot else self.on_demand


@dataclass(frozen=True)
class Machine:
    name: str
    cloud: str
    vcpus: int
    memory_gib: float
    gpus: int                    # built in (AWS instances, GCP G2); 0 for a machine GPUs are attached to
    accelerator: str | None
    network_gbps: float
    gpu_link: str | None         # how GPUs in one machine talk: pcie, nvlink; None with 0 or 1 GPU
    price: Price


@dataclass(frozen=True)
class Accelerator:
    name: str
    names: tuple[str, ...]
    memory_gib: float
    memory_gb_per_s: float
    tflops: dict[str, float]     # dense peak per precision; a missing precision is not supported
    attach: Price | None         # $ per GPU attached to a machine (GCP N1); None for built-in GPUs
    host: str | None             # the machine it is attached to when cost.instance_type does not say


@dataclass(frozen=True)
class Node:
    """A machine with the GPUs it carries: what one cloud node costs and holds."""

    machine: Machine
    accelerator: Accelerator | None
    gpus: int

    @property
    def name(self) -> str:
        if self.machine.gpus or not self.accelerator:
            return self.machine.name
        count = f"{self.gpus}x" if self.gpus > 1 else ""
        return f"{self.machine.name}+{count}{self.accelerator.names[-1]}"

    def usd_per_hour(self, spot: bool) -> float:
        price = self.machine.price.at(spot)
        if self._attached():
            price += self.gpus * self.accelerator.attach.at(spot)
        return price

    def dated(self) -> str:
        prices = [self.machine.price] + ([self.accelerator.attach] if self._attached() else [])
        return "; ".join(f"list price of {p.date}, {p.source}" for p in prices)

    def _attached(self) -> bool:
        return bool(self.accelerator and self.accelerator.attach and not self.machine.gpus)


@dataclass(frozen=True)
class PriceTable:
    machines: dict[str, Machine]
    accelerators: dict[str, Accelerator]
    path: Path

    @classmethod
    def load(cls, path: Path = TABLE_PATH) -> "PriceTable":
        """The table at `path`; an empty one where there is no file (a raydl installed without cluster/)."""
        return _load_table(Path(path))

    def accelerator(self, device: str) -> Accelerator | None:
        """The listed GPU whose name is a word of `device` ("NVIDIA A10G", "nvidia-tesla-t4")."""
        return next((a for a in self.accelerators.values() if _names_match(a.names, device)), None)

    def node(self, spec: str, *, field: str = "cost.instance_type") -> Node:
        """'g5.2xlarge', or a machine with attached GPUs: 'n1-standard-8+nvidia-tesla-t4', '...+2xnvidia-tesla-t4'."""
        match = _NODE.match(spec)
        machine = self.machines.get(match["machine"]) if match else None
        if machine is None:
            raise ConfigError(field, f"is {spec!r}, which is not a machine of {self.path} "
                              f"(it lists {', '.join(self.machines) or 'none'})",
                              "add the machine and its price there, or leave cost.instance_type empty and give the "
                              "price per device-hour: --set cost.prices.<GPU name>=<$/h> (cpu_core on CPU runs)")
        if not match["accelerator"]:
            return Node(machine, self.accelerators.get(machine.accelerator or ""), machine.gpus)
        return Node(machine, self._attachable(match["accelerator"], spec, field), int(match["count"] or 1))

    def _attachable(self, name: str, spec: str, field: str) -> Accelerator:
        accelerator = self.accelerator(name)
        if accelerator is None or accelerator.attach is None:
            attachable = [a.names[-1] for a in self.accelerators.values() if a.attach]
            raise ConfigError(field, f"is {spec!r}, but {name!r} is not a GPU that {self.path} prices per attached "
                              f"GPU (those are: {', '.join(attachable) or 'none'})",
                              "name a listed machine, or MACHINE+GPU with one of those GPUs")
        return accelerator

    def cheapest_node(self, accelerator: Accelerator) -> Node | None:
        """The listed machine that carries this GPU (built in, or attached to its host) for the least per GPU
        (on demand)."""
        nodes = [Node(m, accelerator, m.gpus) for m in self.machines.values() if m.accelerator == accelerator.name]
        if accelerator.host in self.machines:
            nodes.append(Node(self.machines[accelerator.host], accelerator, 1))
        return min(nodes, key=lambda n: n.usd_per_hour(False) / n.gpus, default=None)


def _names_match(names: tuple[str, ...], device: str) -> bool:
    words = {w.lower() for w in re.split(r"[^A-Za-z0-9]+", device) if w} | {device.lower()}
    return any(n.lower() in words for n in names)


@functools.lru_cache(maxsize=8)
def _load_table(path: Path) -> PriceTable:
    if not path.is_file():
        return PriceTable({}, {}, path)
    data = yaml.safe_load(path.read_text()) or {}
    where = str(path)
    accelerators = {name: _accelerator(name, row, f"{where}: accelerators.{name}")
                    for name, row in _mapping(data, "accelerators", where).items()}
    machines = {name: _machine(name, row, f"{where}: machines.{name}")
                for name, row in _mapping(data, "machines", where).items()}
    return PriceTable(machines, accelerators, path)


def _mapping(data: Any, key: str, where: str) -> dict[str, Any]:
    value = data.get(key) if isinstance(data, dict) else None
    if not isinstance(value, dict) or not all(isinstance(v, dict) for v in value.values()):
        raise ConfigError(f"{where}: {key}", "must be a mapping of name -> fields", "see the file's header")
    return value


def _number(row: dict[str, Any], key: str, where: str) -> float:
    value = row.get(key)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
        raise ConfigError(f"{where}.{key}", f"is {value!r}", "give a finite number >= 0")
    return float(value)


def _price(row: dict[str, Any], where: str) -> Price:
    return Price(on_demand=_number(row, "on_demand", where), spot=_number(row, "spot", where),
                 date=str(row.get("date", "?")), source=str(row.get("source", "?")))


def _machine(name: str, row: dict[str, Any], where: str) -> Machine:
    return Machine(name=name, cloud=str(row.get("cloud", "?")), vcpus=int(_number(row, "vcpus", where)),
                   memory_gib=_number(row, "memory_gib", where), gpus=int(_number(row, "gpus", where)),
                   accelerator=row.get("accelerator"), network_gbps=_number(row, "network_gbps", where),
                   gpu_link=row.get("gpu_link"), price=_price(row, where))


def _accelerator(name: str, row: dict[str, Any], where: str) -> Accelerator:
    tflops = row.get("tflops") or {}
    return Accelerator(name=name, names=tuple(str(n) for n in row.get("names", [name])),
                       memory_gib=_number(row, "memory_gib", where),
                       memory_gb_per_s=_number(row, "memory_gb_per_s", where),
                       tflops={k: _number(tflops, k, f"{where}.tflops") for k in tflops},
                       attach=_price(row["attach"], f"{where}.attach") if row.get("attach") else None,
                       host=row.get("host"))


# ---------------------------------------------------------------------------------------------
# Pricing a run's device


@dataclass(frozen=True)
class Rate:
    """How one device-hour of this run is priced."""

    unit: str                          # "GPU" or "CPU core"
    units_per_worker: float
    usd_per_unit_hour: float | None    # None: no price known (see priced_as)
    priced_as: str

    def to_dict(self) -> dict[str, Any]:
        return {"unit": self.unit, "units_per_worker": self.units_per_worker,
                "usd_per_unit_hour": self.usd_per_unit_hour, "priced_as": self.priced_as}


@dataclass(frozen=True)
class Pricing:
    """A run's price settings (cost.*, scaling.*_per_worker) and the table; `rate` prices a device."""

    cost: CostSection
    scaling: ScalingSection
    table: PriceTable

    @classmethod
    def for_config(cls, cfg: JobConfig, table: PriceTable | None = None) -> "Pricing":
        """Raises ConfigError for a cost.instance_type the table does not have (run preparation calls this)."""
        pricing = cls(cfg.cost, cfg.scaling, table or PriceTable.load())
        if cfg.cost.instance_type:
            pricing.table.node(cfg.cost.instance_type)
        return pricing

    @classmethod
    def for_run_dir(cls, run_dir: Path) -> "Pricing":
        """From the run's config.yaml, which run preparation writes before any worker starts (the defaults
        where there is none)."""
        from raydl.overrides import load_config

        path = Path(run_dir) / "config.yaml"
        return cls.for_config(load_config(path) if path.is_file() else JobConfig())

    def rate(self, device: str) -> Rate:
        gpu = device != CPU
        unit, units = ("GPU", self.scaling.gpus_per_worker) if gpu else ("CPU core", self.scaling.cpus_per_worker)
        if self.cost.instance_type:
            usd, why = self._per_device_of_machine(gpu, device)
        elif gpu:
            usd, why = self._per_gpu(device)
        else:
            usd, why = self._per_core()
        return Rate(unit, units, usd, why)

    def _spot(self) -> str:
        return "spot" if self.cost.spot else "on-demand"

    def _per_device_of_machine(self, gpu: bool, device: str) -> tuple[float | None, str]:
        node = self.table.node(self.cost.instance_type)
        per_node, why = self._node_price(node)
        if gpu and not node.gpus:
            return None, f"no price: cost.instance_type {node.name} has no GPU but the workers run on {device}"
        split = node.gpus if gpu else node.machine.vcpus
        return per_node / split, f"{why} / {split} {'GPU' if gpu else 'vCPU'}{'s' if split > 1 else ''}"

    def _node_price(self, node: Node) -> tuple[float, str]:
        if node.name in self.cost.prices:
            return self.cost.prices[node.name], f"{node.name} at cost.prices.{node.name}"
        return node.usd_per_hour(self.cost.spot), f"{node.name} {self._spot()} ({node.dated()})"

    def _per_gpu(self, device: str) -> tuple[float | None, str]:
        accelerator = self.table.accelerator(device)
        names = accelerator.names if accelerator else ()
        override = next((k for k in self.cost.prices if _names_match((k,), device) or k in names), None)
        if override:
            return self.cost.prices[override], f"{device} at cost.prices.{override} per GPU-hour"
        node = self.table.cheapest_node(accelerator) if accelerator else None
        if node is None:
            return None, (f"no price for {device!r} in {self.table.path}: set cost.instance_type, or "
                          f"cost.prices.<its name>=<$ per GPU-hour>")
        per_node, why = self._node_price(node)
        return per_node / node.gpus, f"{why} / {node.gpus} (the cheapest listed machine per {accelerator.name})"

    def _per_core(self) -> tuple[float | None, str]:
        if "cpu_core" in self.cost.prices:
            return self.cost.prices["cpu_core"], "cost.prices.cpu_core per core-hour"
        return None, ("no price: a CPU run is priced only when cost.instance_type names the machine it runs on "
                      "or cost.prices.cpu_core gives $ per core-hour")


# ---------------------------------------------------------------------------------------------
# Accounting


class CostMeter:
    """Running device-hours and $ of one run directory, fed the step records in the order they were reported."""

    def __init__(self, pricing: Pricing):
        self.pricing = pricing
        self.device_hours = 0.0
        self.usd: float | None = 0.0
        self.rate: Rate | None = None
        self.last: tuple[float, int] | None = None   # (time, world_size) of the last step charged

    def resume(self, line: dict[str, Any]) -> None:
        """Continue the totals of a run directory's last metrics.jsonl line (a torchrun restart in place)."""
        if "device_hours" in line:
            self.device_hours, self.usd = line["device_hours"], line.get("cost_usd")
            self.last = (line["time"], line["world_size"])

    def charge(self, records: list[StepRecord], *, device: str, group_start: bool) -> None:
        """Add the records' device time (and the restart gap before a new group) and write the running
        totals into each record."""
        if not records:
            return
        self.rate = self.pricing.rate(device)
        first = records[0]
        if group_start and self.last:
            gap = max(0.0, first.time - first.elapsed_s - self.last[0])
            self._add(gap * min(self.last[1], first.world_size))
        for r in records:
            self._add(r.elapsed_s * r.world_size)
            r.device_hours, r.cost_usd = self.device_hours, self.usd
        self.last = (records[-1].time, records[-1].world_size)

    def _add(self, worker_seconds: float) -> None:
        hours = worker_seconds * self.rate.units_per_worker / 3600
        self.device_hours += hours
        price = self.rate.usd_per_unit_hour
        self.usd = None if self.usd is None or price is None else self.usd + hours * price

    def summary(self) -> dict[str, Any]:
        return {"device_hours": self.device_hours, "cost_usd": self.usd,
                "pricing": self.rate.to_dict() if self.rate else None}

    def progress(self) -> str:
        """'0.0278 core-h $1.00' with a price, '0.0278 core-h' without one."""
        unit = self.rate.unit.split()[-1] if self.rate else "device"
        hours = f"{format_hours(self.device_hours)} {unit}-h"
        return hours if self.usd is None else f"{hours} {format_usd(self.usd)}"


def format_usd(usd: float | None) -> str:
    """Dollars as people write them, in every line and table that shows money: '$12.34', '$0.12', '< $0.01' below
    a cent (never 2.1e-05), '-' where no price applies (None)."""
    if usd is None:
        return "-"
    return "< $0.01" if 0 < usd < 0.01 else f"${usd:,.2f}"


def format_hours(hours: float) -> str:
    """Three significant digits without exponent notation: '0.000556', '0.0278', '12.3', '1,234'."""
    if hours <= 0:
        return "0"
    decimals = max(0, 2 - math.floor(math.log10(hours)))
    return f"{hours:,.{decimals}f}"


def last_line(path: Path) -> dict[str, Any] | None:
    """The last JSON line of a metrics.jsonl (read from its end: the file grows with the run)."""
    if not path.is_file():
        return None
    with path.open("rb") as f:
        f.seek(0, 2)
        f.seek(max(0, f.tell() - 65536))
        lines = f.read().splitlines()
    for raw in reversed(lines):   # a process killed mid-write leaves a partial last line
        try:
            return json.loads(raw)
        except ValueError:
            continue
    return None


__all__ = ["PriceTable", "Pricing", "Rate", "CostMeter", "Node", "Machine", "Accelerator", "format_usd", "format_hours",
           "last_line", "TABLE_PATH", "CPU"]
