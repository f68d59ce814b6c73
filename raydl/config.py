"""The one typed configuration of a raydl run.

Every way into raydl (YAML file, `--set section.key=value`, Ray Tune trial dicts,
`jobs/train.py`) produces a `JobConfig` through `load_config`, so there is exactly one
place that knows the fields, their types, their defaults and what they mean.
Each field carries its help text in `metadata["help"]`: `raydl train --help` prints it.
Checks that need the world size (divisibility of the global batch, layouts) happen when
a worker group starts, in `raydl.parallel.mesh`.
"""

from __future__ import annotations

import dataclasses
import math
import types
import typing
import urllib.parse
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from raydl.config_lora import lora_settings
from raydl.config_rules import check_tracker, validate
from raydl.errors import ConfigError
from raydl.parallel import schedules

PRECISIONS = ("fp32", "bf16", "fp16", "fp8")
# Precisions that compute in bf16: fp8 casts the matmuls it takes to float8 and computes the rest in bf16.
BF16_COMPUTE = ("bf16", "fp8")
FP8_SCALINGS = ("tensorwise", "rowwise")
OPTIMIZERS = ("adamw", "sgd")
LR_SCHEDULES = ("cosine", "linear", "constant")
DP_WRAPPERS = ("auto", "fsdp", "replicate", "ddp")


def _f(default: Any, help: str, *, choices: tuple[str, ...] | None = None) -> Any:
    """A dataclass field with its help text (and allowed values) attached."""
    meta = {"help": help, "choices": choices}
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda: type(default)(default), metadata=meta)
    return field(default=default, metadata=meta)


@dataclass(kw_only=True)
class RunSection:
    name: str = _f("raydl", "Run name; the run directory is <runs_dir>/<name>-<timestamp>/.")
    runs_dir: str = _f("runs", "Parent folder of run directories (local path).")
    dir: str = _f("", "Explicit run directory; empty = <runs_dir>/<name>-<timestamp>.")


@dataclass(kw_only=True)
class ModelSection:
    name: str = _f("gpt", "Model: gpt (decoder-only transformer), resnet (CIFAR-style), hf (a Hugging Face causal LM), "
                   "or package.module:attribute naming a raydl.ModelSpec (or a function returning one) in a module "
                   "importable from the working directory.")
    size: str = _f("tiny", "Size preset, passed to the model's options as 'size'. gpt: tiny (~1M params), mini, small, "
                   "gpt2 (124M). resnet: tiny, resnet18.")
    options: dict[str, Any] = _f({}, "The model's own options (--set model.options.KEY=VALUE), checked against its "
                                 "ModelSpec.options; the built-in models' are listed below.")
    dropout: float = _f(0.0, "Dropout probability, passed to the model's options as 'dropout' (gpt: inside transformer blocks).")
    activation_checkpointing: bool = _f(False, "Recompute each block's activations in backward (less memory, ~30% more compute).")


@dataclass(kw_only=True)
class DataSection:
    path: str = _f("builtin", "Parquet dataset directory or URI (s3://, gs://, any pyarrow filesystem); "
                   "'builtin' generates the model's default learnable task on first use.")
    builtin_samples: int = _f(24576, "Rows of the built-in dataset (train + eval).")
    shard_rows: int = _f(2048, "Rows per parquet shard when raydl writes a dataset.")
    eval_fraction: float = _f(0.0625, "Share of the built-in dataset held out for evaluation.")
    cache_dir: str = _f(".raydl_data", "Where the built-in dataset is generated (reused if already there): a local "
                        "path or a URI, like data.path.")
    shared_local: bool = _f(False, "The local dataset (data.path, or the built-in one in data.cache_dir) is at the "
                            "same path on every node (NFS, or copied there): lets a multi-node or autoscaling cluster "
                            "read it, after raydl checks each node's manifest.json against the driver's. Without it "
                            "such a run is refused: every worker reads the dataset on its own node.")
    shuffle: bool = _f(True, "Seeded shuffle that differs per epoch (same seed + epoch = same order).")
    max_bad_shards: int = _f(0, "Corrupt shards to skip (and count) before failing; 0 = fail on the first.")
    prefetch_batches: int = _f(2, "Batches each worker reads ahead so that reading overlaps compute.")
    backend: str = _f("arrow", "Who reads the shards: arrow (pyarrow in each training process; the only one under "
                      "torchrun, and the one to use when the workers take every CPU) or ray (Ray Data read tasks on "
                      "the cluster's CPUs beside the workers, streaming several epochs per execution). Both give the "
                      "same rows in the same exactly-once order.",
                      choices=("arrow", "ray"))
    read_cpus: float = _f(1.0, "CPUs each Ray Data read task reserves (data.backend=ray). Leave CPUs free for them "
                          "(scaling.cpus_per_worker below the node's count), or use a fraction to share.")
    augment: bool = _f(True, "Random flip and shift of training images (image datasets), drawn from "
                       "(seed, epoch, sample id) so every backend, rank and restart agrees.")


@dataclass(kw_only=True)
class ParallelSection:
    pp_degree: int | str = _f(1, "Pipeline-parallel degree (stages across workers), or 'auto' to let the planner choose.")
    schedule: str = _f("1f1b", f"Pipeline schedule: {', '.join(schedules.NAMES)}.", choices=schedules.NAMES)
    num_microbatches: int = _f(0, "Pipeline micro-batches per step and replica; 0 = derived from the batch sizes.")
    stage_cuts: list[int] = _f([], "Manual stage boundaries (block index where each later stage starts); overrides the planner.")
    dp_wrapper: str = _f("auto", "Data-parallel wrapper: auto (at every worker-group start: ddp, or replicate with "
                         "pipelines, when params + grads + optimizer states fit in half a device; else fsdp; the choice "
                         "and why go into the layout line and summary.json), fsdp (FSDP2 fully_shard; composes with "
                         "every pipeline schedule), replicate (FSDP2-based DDP), ddp (classic DistributedDataParallel; "
                         "refused with pipeline parallelism).",
                         choices=DP_WRAPPERS)


@dataclass(kw_only=True)
class TrainSection:
    optimizer: str = _f("adamw", "Optimizer: adamw or sgd.", choices=OPTIMIZERS)
    # 1e-3: the built-in sums learnt from every seed tried (eval token accuracy 1.0, seeds 0-2, AMD EPYC, 2026-11-26).
    # 3e-3 learnt them on an Intel Xeon (0.99-1.0) but on the AMD machine, whose kernels round differently, left
    # two seeds of three on the loss plateau (~1.55) for hundreds of steps (0.86, 0.66 at step 800).
    lr: float = _f(1e-3, "Peak learning rate (after warmup).")
    weight_decay: float = _f(0.0, "Decoupled weight decay (adamw) or L2 (sgd).")
    beta1: float = _f(0.9, "AdamW beta1.")
    beta2: float = _f(0.95, "AdamW beta2.")
    momentum: float = _f(0.9, "SGD momentum.")
    lr_schedule: str = _f("cosine", "Decay after warmup: cosine, linear or constant.", choices=LR_SCHEDULES)
    warmup_steps: int = _f(20, "Linear warmup steps from 0 to lr.")
    min_lr_ratio: float = _f(0.1, "Final lr as a fraction of lr (cosine/linear).")
    global_batch_size: int = _f(64, "Samples per optimizer step over all workers; kept constant when the world size changes.")
    micro_batch_size: int = _f(32, "Samples per forward/backward on one worker; accumulation = global / (micro * data-parallel size).")
    # 800: the built-in sums are learnt from every seed tried (eval token accuracy 1.0, seeds 0-2, at lr 1e-3); they
    # are learnt by step ~400-500, after a plateau whose length depends on the initial draw.
    max_steps: int = _f(800, "Optimizer steps to train; 0 = use max_epochs.")
    max_epochs: int = _f(0, "Epochs to train when max_steps is 0.")
    precision: str = _f("fp32", "fp32, bf16 (autocast; with FSDP2 fully_shard or replicate also bf16 parameters for "
                        "compute and fp32 gradient reduction, the fp32 parameters and optimizer states staying "
                        "master), fp16 (autocast + GradScaler) or fp8 (bf16 as above, and the Linear layers of the "
                        "repeated blocks that are large enough to gain run their matmuls in float8 through torchao, "
                        "`pip install -e \".[fp8]\"`; the head, norms, embeddings and the loss stay bf16/fp32; needs "
                        "GPUs of compute capability 8.9 or more: H100, H200, L4, Ada).", choices=PRECISIONS)
    fp8_scaling: str = _f("tensorwise", "train.precision=fp8: how float8 scales are taken, per tensor (tensorwise: "
                          "faster) or per row (rowwise: closer to bf16's numerics). torchao's size filter for that "
                          "recipe leaves the layers too small to gain in bf16.", choices=FP8_SCALINGS)
    cpu_offload: bool = _f(False, "GPU with parallel.dp_wrapper=fsdp: keep the parameter shards, gradients and "
                           "optimizer states in host memory (FSDP2 CPUOffloadPolicy; the optimizer steps on the CPU), "
                           "copying each block to the GPU when it runs: frees their device memory, costs a host-device "
                           "copy per block per step and a CPU optimizer step. On CPU workers it changes nothing (a "
                           "warning says so).")
    host_mmap_threshold_kib: int | str = _f("auto", "Each worker's host allocations of at least this many KiB "
                                            "are mapped from the OS and returned to it when freed (glibc "
                                            "M_MMAP_THRESHOLD). glibc's default raises this threshold up to 32 MiB "
                                            "as a run frees large blocks, and its heap then keeps them: a 302M gpt's "
                                            "FSDP worker (dp=2) peaked 2.1x the fp32 model above a tiny model's run, "
                                            "1.14x with 1024; each mapping costs page faults instead (a 100M gpt at "
                                            "dp=1: 0.83x the steps/s, no memory saved). auto = 1024 with fully_shard, "
                                            "a pipeline or CPU offload, else (DDP, one worker) glibc's default; "
                                            "0 = glibc's default.")
    grad_clip: float = _f(1.0, "Clip the global gradient norm to this value; 0 = off.")
    optimizer_in_backward: bool = _f(False, "Step each block's parameters as soon as their gradients are final and "
                                     "free those gradients, so a worker never holds all its gradients (FSDP2 fully_shard "
                                     "across workers; one worker alone is not wrapped): saves about one copy of "
                                     "the parameters it owns. Needs train.grad_clip=0, parallel.pp_degree=1 "
                                     "and no fp16; full restarts only (no survivors path).")
    compile: str = _f("auto", "torch.compile each repeated block of the model on its own (torchtitan's per-block "
                      "compile: one compilation serves every identical block), inside the data-parallel wrapper, "
                      "after activation checkpointing, in every pipeline stage. auto = on for CUDA workers, off on "
                      "CPU (Inductor's C++ backend compiles slowly and gains little there), and eager with one "
                      "log line where this machine cannot compile; true = compile or refuse to start; false = "
                      "eager. Each new per-rank batch shape compiles once more (summary.json's compile.recompiles).",
                      choices=("auto", "true", "false"))
    seed: int = _f(0, "Seed for model init, data order and dropout.")
    eval_every: int = _f(0, "Evaluate every N steps (0 = only at the end).")
    eval_batches: int = _f(8, "Micro-batches per evaluation on each worker.")
    init_from: str = _f("", "Start this new run from trained weights only: a raydl run directory (its newest usable "
                        "checkpoint), one of its checkpoints (train/step_N), or a Hugging Face save_pretrained "
                        "directory (model.name=hf; as model.options.weights). No optimizer state, no data position: "
                        "step 0 on this run's dataset, at any layout. The model this config builds must fit the "
                        "weights, and its vocabulary the dataset's tokenizer (both checked before any worker starts). "
                        "Not a resume (--resume continues a run).")
    lora: dict[str, Any] = _f({}, "LoRA through peft (`pip install \"raydl[lora]\"`): train low-rank adapters on "
                              "chosen Linear layers, the model's own weights frozen (their values bitwise unchanged; "
                              "no gradients and no optimizer state for them). Empty = off (full fine-tuning). Keys: rank "
                              "(int >= 1, required, e.g. --set train.lora.rank=8), alpha (scale numerator, default "
                              "2 x rank), dropout (on the adapters' input, 0 <= p < 1, default 0), targets (list of "
                              "module names or name suffixes, e.g. [q_proj, v_proj] or [qkv]; default all-linear: "
                              "every Linear layer but the output head). Applied before the pipeline split and data "
                              "parallelism; checkpoints hold the adapters with the base weights' location and digest "
                              "(docs/finetune.md).")

    def __post_init__(self) -> None:
        lora_settings(self.lora)


@dataclass(kw_only=True)
class CheckpointSection:
    every_steps: int = _f(100, "Save a checkpoint every N steps (and at the end).")
    keep: int = _f(2, "Number of checkpoints to keep (on the survivors path the leader keeps as many again of "
                   "its own, written while the group is smaller, until the whole group checkpoints).")
    storage_path: str = _f("", "Where checkpoints go: a local path or a URI (s3://, gs://, any pyarrow or fsspec "
                           "filesystem); empty = the run directory. On a cluster of several nodes (or an autoscaling "
                           "one) it must be a URI, or a path every node mounts (see shared_local).")
    shared_local: bool = _f(False, "The local checkpoint path (storage_path, or the run directory) is on storage every "
                            "node mounts (NFS): lets a multi-node or autoscaling cluster checkpoint there. Without it "
                            "such a run is refused, since a node that dies takes its local disk with it.")
    memory_every_steps: int = _f(0, "Under Ray: every N steps each rank hands its shard of the training state (its part "
                                 "of the model and optimizer, the step, the data position) to an actor on the driver's "
                                 "node, so that a restart of the whole worker group after a worker dies reloads it from "
                                 "there and redoes at most N steps, instead of every step since the last storage "
                                 "checkpoint. Costs one copy of the whole state (two while a step's shards arrive) in "
                                 "that node's RAM and a copy of its shard per N steps on each rank: on the default run "
                                 "(tiny GPT, DDP, 2 CPU workers) N=1 halved its throughput (0.47), so 0 = off is the "
                                 "default (docs/restart-from-memory.md).")


@dataclass(kw_only=True)
class ScalingSection:
    min_workers: int = _f(2, "Fewest workers to train with (elastic when < max_workers).")
    max_workers: int = _f(2, "Most workers to train with.")
    use_gpu: str = _f("auto", "auto (GPUs when the cluster has them), true or false.", choices=("auto", "true", "false"))
    cpus_per_worker: float = _f(1.0, "CPUs reserved per worker.")
    gpus_per_worker: float = _f(1.0, "GPUs reserved per worker when GPUs are used.")
    max_failures: int = _f(3, "Worker-group failures to retry (-1 = unlimited); preemptions are not counted.")
    resize_check_s: float = _f(30.0, "Seconds between checks for a bigger/smaller cluster (Ray default: 60).")
    worker_start_timeout_s: float = _f(15.0, "Seconds to wait for a worker group to start before trying a smaller one (Ray default: 60).")
    memory_per_worker_gb: float = _f(0.0, "Memory budget of one worker (GiB) that the predicted peak of a layout "
                                     "must fit (raydl.parallel.memory; refused before any worker starts otherwise); "
                                     "0 = the GPU's memory, or on CPU this node's RAM / the workers on it.")
    fit_timeout_s: float = _f(600.0, "Seconds to wait, on a cluster given by --address (which may autoscale), until "
                              "min_workers workers fit before failing with the numbers; a local Ray fails at once.")
    survivors: str = _f("auto", "When a worker dies, the others keep training and a replacement copies a live peer "
                        "(torchft; data-parallel layouts with DDP, two workers or more): auto (wherever the layout "
                        "allows it, else full restarts), on (required: a layout that cannot is refused), off (every "
                        "failure restarts the whole group from its last checkpoint). A worker whose node is lost "
                        "too: the others train on at the smaller size and its replacement waits for a node to be "
                        "placed on, also in an elastic run (min_workers < max_workers), which otherwise restarts "
                        "smaller; only a failure of every worker restarts the group. Its steady cost against off: "
                        "benchmarks/README.md#recovery-overhead.",
                        choices=("auto", "on", "off"))
    survivor_timeout_s: float = _f(1.0, "Seconds without a heartbeat from a worker before the survivors go on "
                                   "without it (torchft Lighthouse heartbeat timeout; scaling.survivors).")


@dataclass(kw_only=True)
class TelemetrySection:
    report_every: int = _f(10, "Every N steps: send the steps' records to metrics.jsonl and the progress line, and "
                                 "check for a diverged loss, a stop request and a preemption notice (one all-reduce).")
    progress: bool = _f(True, "Print a progress line on rank 0.")
    nvml: bool = _f(True, "Read GPU utilisation, memory, power and temperature through NVML when on GPU.")
    tensorboard: bool = _f(False, "Also write every metric of metrics.jsonl, restarts and layouts as TensorBoard "
                           "events, to <run_dir>/tensorboard (a sweep: <sweep_dir>/tensorboard/<trial>); view with "
                           "`tensorboard --logdir runs/`. Needs pip install \"raydl[tensorboard]\" (checked before "
                           "Ray starts); off by default because that extra is optional and metrics.jsonl has it all.")
    mlflow: dict[str, str] = _f({}, "Also log the run to MLflow: --set telemetry.mlflow.tracking_uri=http://HOST:PORT "
                                "(http, https, sqlite, postgresql, mysql, file or databricks) and optionally "
                                "telemetry.mlflow.experiment=NAME (default raydl). The effective config as params, "
                                "every number of metrics.jsonl as metrics by step, restarts and resizes as tags, "
                                "summary.json and report.png as artifacts; a sweep: a parent run and a child run per "
                                "trial. Needs pip install \"raydl[mlflow]\" (checked before Ray starts); {} = off.")
    wandb: dict[str, str] = _f({}, "Also log the run to Weights & Biases, like telemetry.mlflow: --set "
                               "telemetry.wandb.project=NAME, optionally telemetry.wandb.mode=online|offline (default "
                               "online; offline writes <run_dir>/wandb for `wandb sync`, no network) and "
                               "telemetry.wandb.entity=TEAM; a sweep groups its trials' runs under its name. Needs pip "
                               "install \"raydl[wandb]\" (checked before Ray starts); {} = off.")
    profile_steps: int = _f(0, "Profile N steps with torch.profiler after the warm-up (3 steps) of each worker-group "
                            "start: a Chrome trace per rank in <run_dir>/profile/rank<r>.json (Perfetto, "
                            "chrome://tracing) and where each rank's step time goes in <run_dir>/profile/"
                            "breakdown.json and on stdout; 0 = off. `raydl profile --steps N` is a short run with it.")


    def __post_init__(self) -> None:
        check_tracker("telemetry.mlflow", self.mlflow, required=("tracking_uri",), optional=("experiment",))
        check_tracker("telemetry.wandb", self.wandb, required=("project",), optional=("mode", "entity"))
        uri = self.mlflow.get("tracking_uri", "")
        if self.mlflow and urllib.parse.urlsplit(uri).scheme not in MLFLOW_SCHEMES:
            raise ConfigError("telemetry.mlflow.tracking_uri", f"is {uri!r}, whose scheme is not one MLflow tracks to "
                              f"({', '.join(MLFLOW_SCHEMES)})", "give the server's address, e.g. --set "
                              "telemetry.mlflow.tracking_uri=http://127.0.0.1:5000, or a store such as "
                              "sqlite:///mlflow.db")
        mode = self.wandb.get("mode", "online")
        if mode not in WANDB_MODES:
            raise ConfigError("telemetry.wandb.mode", f"is {mode!r}, not one of {', '.join(WANDB_MODES)}",
                              "set --set telemetry.wandb.mode=offline to log without a network")


MLFLOW_SCHEMES = ("http", "https", "sqlite", "postgresql", "mysql", "file", "databricks")
WANDB_MODES = ("online", "offline")


@dataclass(kw_only=True)
class DebugSection:
    """Test hooks (the data loader's ledger, raydl.data.ledger; a survivor's peer copy, raydl.train.survivors; a hold
    at a step, raydl.train.hold; memory marks and limits); off by default, and then they cost nothing."""
    ledger_dir: str = _f("", "Write the sample ids each rank hands to training to <dir>/ledger-<pid>-dp<rank>.jsonl, "
                         "for exactly-once tests; empty = off. A directory every worker can write (local runs); made if missing.")
    fail_at_step: int = _f(-1, "The first rank to reach this global step raises, once per debug.ledger_dir (a "
                           "marker file there), to test restarts; -1 = off.")
    peer_copy_hold_s: float = _f(0.0, "On the survivors path, a worker sending its state to a replacement that "
                                 "catches up first writes <debug.ledger_dir>/peer-copy-<pid> and waits this many "
                                 "seconds: a window in which a test kills a worker during the copy; 0 = off.")
    hold_at_step: int = _f(-1, "After reporting this global step every rank writes <debug.ledger_dir>/held-<pid> "
                           "and waits, until <debug.ledger_dir>/release exists or a drain notice comes: a test "
                           "changes the cluster while the run trains, at a known step, however slow the machine; "
                           "-1 = off.")
    memory_dir: str = _f("", "Write each rank's peak memory (RSS on CPU, max allocated on GPU) after its model is "
                         "built and loaded, and at the end, to <dir>/memory-rank<r>.json (raydl bench memory); "
                         "empty = off.")
    whole_model_build: bool = _f(False, "Build the whole model with real values on every worker, as raydl did before "
                                 "building on meta (raydl bench memory's 'before' side); off = build on meta.")
    memory_limit_mb: int = _f(0, "Let each worker allocate at most N MiB of host memory beyond what it holds when its "
                              "model build starts (RLIMIT_DATA); past it an allocation fails. Shows that a layout "
                              "trains within less memory than the whole model needs (tests/dist/test_memory_limit.py); "
                              "0 = off.")

    def __post_init__(self) -> None:
        if self.fail_at_step != -1 and self.fail_at_step < 1:
            raise ConfigError("debug.fail_at_step", f"is {self.fail_at_step}", "use -1 (off) or a step >= 1")
        if self.memory_limit_mb < 0:
            raise ConfigError("debug.memory_limit_mb", f"is {self.memory_limit_mb}", "use 0 (off) or a size in MiB")
        if self.peer_copy_hold_s < 0:
            raise ConfigError("debug.peer_copy_hold_s", f"is {self.peer_copy_hold_s}", "use 0 (off) or seconds > 0")
        if self.peer_copy_hold_s and not self.ledger_dir:
            raise ConfigError("debug.peer_copy_hold_s", "needs debug.ledger_dir, where the sender marks the copy",
                              "set --set debug.ledger_dir=DIR as well")
        if self.hold_at_step != -1 and self.hold_at_step < 1:
            raise ConfigError("debug.hold_at_step", f"is {self.hold_at_step}", "use -1 (off) or a step >= 1")
        if self.hold_at_step != -1 and not self.ledger_dir:
            raise ConfigError("debug.hold_at_step", "needs debug.ledger_dir, where the ranks mark the hold and "
                              "the test releases it", "set --set debug.ledger_dir=DIR as well")
        if self.fail_at_step != -1 and not self.ledger_dir:
            raise ConfigError("debug.fail_at_step", "needs debug.ledger_dir, where the failure marks that it "
                              "happened (it fires once)", "set --set debug.ledger_dir=DIR as well")


@dataclass(kw_only=True)
class CostSection:
    """How device-hours are priced (raydl.telemetry.cost; the price table is cluster/prices.yaml)."""
    instance_type: str = _f("", "Machine the workers run on, a machine of cluster/prices.yaml (g5.2xlarge, "
                            "g2-standard-8, n1-standard-8+nvidia-tesla-t4): its price per hour is split over its GPUs, "
                            "or its vCPUs on a CPU run. Empty: a GPU run is priced by the GPU the workers report (its "
                            "cheapest listed machine per GPU); a CPU run only at cost.prices.cpu_core, else it shows "
                            "core-hours and no $.")
    spot: bool = _f(False, "Price at the table's spot price instead of on-demand (spot prices move; the table's are "
                    "typical levels, to be checked).")
    prices: dict[str, float] = _f({}, "$ per hour replacing the table's: a machine (per instance-hour), a GPU by any "
                                  "of its names (per GPU-hour; also one the table lacks, e.g. H100) or cpu_core (per "
                                  "core-hour), e.g. --set cost.prices.g5.2xlarge=1.1 or --set cost.prices.H100=2.5.")

    def __post_init__(self) -> None:
        for name, usd in self.prices.items():
            if isinstance(usd, bool) or not isinstance(usd, (int, float)) or not math.isfinite(usd) or usd < 0:
                raise ConfigError(f"cost.prices.{name}", f"is {usd!r}, not a price", "give $ per hour as a finite "
                                  f"number >= 0, e.g. --set cost.prices.{name}=1.2")


@dataclass(kw_only=True)
class JobConfig:
    run: RunSection = field(default_factory=RunSection)
    model: ModelSection = field(default_factory=ModelSection)
    data: DataSection = field(default_factory=DataSection)
    parallel: ParallelSection = field(default_factory=ParallelSection)
    train: TrainSection = field(default_factory=TrainSection)
    checkpoint: CheckpointSection = field(default_factory=CheckpointSection)
    scaling: ScalingSection = field(default_factory=ScalingSection)
    telemetry: TelemetrySection = field(default_factory=TelemetrySection)
    debug: DebugSection = field(default_factory=DebugSection)
    cost: CostSection = field(default_factory=CostSection)

    def __post_init__(self) -> None:
        validate(self)

    def to_dict(self) -> dict[str, dict[str, Any]]:
        return dataclasses.asdict(self)


SECTIONS: dict[str, type] = {f.name: f.default_factory for f in dataclasses.fields(JobConfig)}  # type: ignore[misc]


def field_type(section: str, key: str) -> Any:
    hints = typing.get_type_hints(SECTIONS[section])
    return hints[key]


def iter_fields():
    """Yield (section, field) for every config field, in declaration order."""
    for section, cls in SECTIONS.items():
        for f in dataclasses.fields(cls):
            yield section, f


def is_union(tp: Any) -> bool:
    return typing.get_origin(tp) in (typing.Union, types.UnionType)


def default_run_dir(cfg: JobConfig, timestamp: str) -> Path:
    return Path(cfg.run.dir) if cfg.run.dir else Path(cfg.run.runs_dir) / f"{cfg.run.name}-{timestamp}"
