"""Per-worker memory of a layout, predicted before any worker starts (pure: no processes, no torch).

    raydl train --set model.options.layers=24 --set model.options.width=1024   # refused with the numbers if it
                                                                               # cannot fit (exit 2)

What one rank holds at its peak (bytes; "owned" = the parameters of its stage(s), divided over dp under FSDP2
fully_shard; parameters stay fp32 masters in every precision):
    weights      owned parameters (0 on the device with CPU offload: they live in host memory)
    grads        one gradient per owned trainable parameter (fp32: FSDP2 reduces in fp32); with train.lora the
                 adapters alone (the base weights are frozen), as for the optimizer states, buckets and step
    optimizer    adamw: 2 states per trainable parameter; sgd with momentum: 1; sgd without: 0
    ddp buckets  classic DDP's gradient buckets: a second copy of the gradients
    unsharded    FSDP2's all-gathered parameters in the compute dtype: at pp = 1 one block being computed, the
                 next one prefetched and the block's unsharded gradient (3 x the largest block); with pp > 1 the
                 stage's blocks stay gathered from forward to backward (no resharding after forward)
    casts        bf16 without FSDP2's mixed precision: autocast's bf16 copy of every weight, kept until backward
    activations  what backward needs, per micro-batch (measured per sample on meta, `raydl.parallel.memory_probe`)
                 x the micro-batches in flight on the rank (the schedule's table, as in the cost model); with
                 activation checkpointing only the blocks' inputs plus one block recomputed; the loss keeps its
                 log-probabilities and its gradient (the last stage); a loss chunked over the vocabulary (raydl's
                 gpt and Hugging Face models) keeps the head's hidden states, and one chunk's logits at a time
    step         the optimizer step's temporaries: adamw on a CPU (torch's per-tensor loop) one buffer the size of
                 the largest owned tensor; fused on a GPU none (measured on an H200: benchmarks/results/gpu-memory-*)
With train.optimizer_in_backward no gradient outlives its parameter's step: grads and step become the gradients
in flight (one block's shard under fully_shard, else the largest tensor) and their step's temporaries, counted
with the activations.
peak = weights + grads + optimizer + ddp buckets + max(unsharded + casts + activations, step). That is an upper
bound where grads and activations overlap least (gradients appear as activations are freed). The process itself
(interpreter, torch, the Ray worker) is `RUNTIME_BYTES` more, counted when checking a budget, not in `peak`.
bf16 activations are taken as 0.6 of fp32's (matmul outputs halve; the residual stream, norms and the loss stay fp32).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Sequence

from raydl.config import BF16_COMPUTE
from raydl.parallel import schedules
from raydl.parallel.cost_model import balanced_cuts, in_flight_chunks

__all__ = ["BlockMemory", "ModelMemory", "Setting", "Prediction", "predict", "build_bytes", "RUNTIME_BYTES",
           "BF16_ACTIVATION_SHARE", "gib", "mib"]

_MIB, _GIB = 2**20, 2**30
# The process without a model: interpreter, torch, gloo, a Ray Train worker (measured here: a tiny model's worker
# peaks at ~0.6 GiB RSS) or a CUDA context on a GPU.
RUNTIME_BYTES = {"cpu": 640 * _MIB, "cuda": 512 * _MIB}
BF16_ACTIVATION_SHARE = 0.6
OPTIMIZER_STATES = {"adamw": 2.0, "sgd": 1.0}   # per parameter; sgd without momentum keeps none
STEP_TEMPORARIES = {"adamw": 1.0, "sgd": 0.0}


@dataclass(frozen=True)
class BlockMemory:
    name: str
    param_bytes: int            # fp32 parameters of the block
    activation_bytes: float     # saved for backward, per sample, fp32 compute
    output_bytes: float         # the block's output per sample (what activation checkpointing keeps)
    largest_tensor_bytes: int = 0
    trainable_bytes: int | None = None   # fp32 parameters that train (LoRA: the adapters alone); None = all of them

    @property
    def trained_bytes(self) -> int:
        return self.param_bytes if self.trainable_bytes is None else self.trainable_bytes


@dataclass(frozen=True)
class ModelMemory:
    """The model as memory sees it: blocks in execution order and what the loss keeps per sample."""
    blocks: tuple[BlockMemory, ...]
    loss_bytes: float = 0.0     # per sample: the loss's saved log-probabilities (its gradient is as large)
    # a loss over the vocabulary chunk by chunk (raydl.models.loss): `loss_bytes` is what it keeps per sample (the
    # hidden states, labels, log-sum-exps; no gradient as large), this its one chunk of logits at a time, per rank
    loss_chunk_bytes: float = 0.0
    tied_bytes: int = 0   # a tied pair's weight, counted in both blocks: one tensor where one module holds both
    activations_known: bool = True   # False: the meta forward failed, activations count as 0

    @property
    def param_bytes(self) -> int:
        return sum(b.param_bytes for b in self.blocks) - self.tied_bytes

    @property
    def largest_tensor_bytes(self) -> int:
        return max(b.largest_tensor_bytes for b in self.blocks)


@dataclass(frozen=True)
class Setting:
    """What besides the layout decides memory: precision, optimizer, activation checkpointing, offload, device."""
    precision: str = "fp32"
    optimizer: str = "adamw"
    momentum: float = 0.9
    activation_checkpointing: bool = False
    cpu_offload: bool = False
    device_type: str = "cpu"
    optimizer_in_backward: bool = False

    @classmethod
    def from_config(cls, cfg, device_type: str) -> "Setting":
        return cls(precision=cfg.train.precision, optimizer=cfg.train.optimizer, momentum=cfg.train.momentum,
                   activation_checkpointing=cfg.model.activation_checkpointing, cpu_offload=cfg.train.cpu_offload,
                   device_type=device_type, optimizer_in_backward=cfg.train.optimizer_in_backward)

    @property
    def optimizer_states(self) -> float:
        return 0.0 if self.optimizer == "sgd" and self.momentum == 0 else OPTIMIZER_STATES[self.optimizer]


@dataclass(frozen=True)
class Prediction:
    rank_peak_bytes: tuple[int, ...]     # per pipeline rank (every dp replica holds the same)
    fullest: int                         # the pipeline rank with the largest peak
    parts: dict[str, int] = field(default_factory=dict)   # the fullest rank's peak, by what it holds
    offloaded_bytes: int = 0             # host memory that CPU offload moved off the device, per rank

    @property
    def peak_bytes(self) -> int:
        return self.rank_peak_bytes[self.fullest]

    def with_runtime(self, device_type: str) -> int:
        return self.peak_bytes + RUNTIME_BYTES[device_type]

    def breakdown(self) -> str:
        """"weights 577 + grads 577 + optimizer 1,153 + max(unsharded 144 + activations 492, step 577) = 2,943 MiB"
        (the fullest rank, MiB)."""
        def terms(names: tuple[str, ...]) -> str:
            return " + ".join(f"{name} {mib(self.parts[name])}" for name in names if self.parts.get(name))
        held, during = terms(_HELD), terms(_DURING_STEP)
        step = f"step {mib(self.parts['step'])}" if self.parts.get("step") else ""
        transient = f"max({during}, {step})" if during and step else during or step
        return f"{' + '.join(t for t in (held, transient) if t)} = {mib(self.peak_bytes)} MiB"


def predict(model: ModelMemory, *, dp: int, pp: int, micro_batch: int, num_microbatches: int = 1,
            schedule: str = "1f1b", stage_cuts: Sequence[int] = (), wrapper: str = "none",
            setting: Setting = Setting()) -> Prediction:
    """Peak bytes of every pipeline rank of this layout (see the module docstring for what is counted)."""
    ranks = [_rank_parts(model, rank, blocks, dp=dp, pp=pp, micro_batch=micro_batch, m=num_microbatches,
                         schedule=schedule, wrapper=wrapper, setting=setting)
             for rank, blocks in enumerate(_rank_blocks(model, pp, schedule, stage_cuts))]
    peaks = [_peak(parts) for parts, _ in ranks]
    fullest = max(range(len(peaks)), key=peaks.__getitem__)
    return Prediction(tuple(peaks), fullest, ranks[fullest][0], ranks[fullest][1])


def build_bytes(model: ModelMemory, *, dp: int, pp: int, schedule: str = "1f1b", stage_cuts: Sequence[int] = (),
                wrapper: str = "none", whole: bool = False) -> int:
    """What the fullest rank holds while it builds and loads its model: its own parameters plus the largest
    tensor (initialized whole, then cut to its rows), or the whole model when it is built whole (`whole`)."""
    if whole:
        return model.param_bytes
    shard = dp if wrapper == "fsdp" else 1
    owned = max(sum(b.param_bytes for stage in stages for b in stage)
                for stages in _rank_blocks(model, pp, schedule, stage_cuts))
    return math.ceil(owned / shard) + (model.largest_tensor_bytes if shard > 1 else 0)


def _rank_blocks(model: ModelMemory, pp: int, schedule: str,
                 stage_cuts: Sequence[int]) -> list[list[list[BlockMemory]]]:
    """Per pipeline rank, its stages, each a list of blocks; the cuts `raydl.parallel.pipeline` uses."""
    if pp == 1:
        return [[list(model.blocks)]]
    num_stages = pp * schedules.get(schedule).stages_per_rank
    cuts = tuple(stage_cuts) or balanced_cuts([1.0] * len(model.blocks), num_stages)
    edges = (0, *cuts, len(model.blocks))
    stages = [list(model.blocks[edges[i]:edges[i + 1]]) for i in range(num_stages)]
    return [[stages[i] for i in schedules.stage_indices(schedule, pp, rank)] for rank in range(pp)]


def _rank_parts(model: ModelMemory, rank: int, stages: list[list[BlockMemory]], *, dp: int, pp: int,
                micro_batch: int, m: int, schedule: str, wrapper: str, setting: Setting) -> tuple[dict[str, int], int]:
    blocks = [b for stage in stages for b in stage]
    params = sum(b.param_bytes for b in blocks) - (model.tied_bytes if pp == 1 else 0)
    fsdp = wrapper == "fsdp" and dp > 1
    owned = params / dp if fsdp else params
    bf16 = setting.precision in BF16_COMPUTE
    fsdp2_mixed = bf16 and wrapper in ("fsdp", "replicate") and dp > 1   # MixedPrecisionPolicy(param_dtype=bf16)
    compute_share = 0.5 if bf16 else 1.0   # bytes of a compute-dtype copy per fp32 byte
    # Gradients and optimizer states exist for the trainable parameters alone (train.lora: the adapters).
    frozen = any(b.trained_bytes < b.param_bytes for b in model.blocks)
    trained = sum(b.trained_bytes for b in blocks) - (model.tied_bytes if pp == 1 and not frozen else 0)
    owned_trained = trained / dp if fsdp else trained
    static = {"weights": owned, "grads": owned_trained, "optimizer": owned_trained * setting.optimizer_states}
    offloaded = 0
    if setting.cpu_offload and setting.device_type == "cuda" and fsdp:
        offloaded = sum(static.values())
        static = {name: 0 for name in static}
    parts = {**static, "ddp buckets": owned_trained if wrapper == "ddp" and dp > 1 else 0}
    if fsdp:
        largest = max(b.param_bytes for b in blocks)
        gathered = params if pp > 1 else 2 * largest   # no resharding after forward with a pipeline
        parts["unsharded"] = compute_share * gathered + compute_share * largest
    elif wrapper == "replicate" and fsdp2_mixed:
        parts["unsharded"] = compute_share * params   # replicate's bf16 copies of the parameters
    if bf16 and not fsdp2_mixed:
        parts["casts"] = 0.5 * params
    parts["activations"] = _activations(model, rank, stages, pp=pp, micro_batch=micro_batch, m=m, schedule=schedule,
                                        setting=setting)
    largest_owned = max(min(b.largest_tensor_bytes, b.trained_bytes) for b in blocks) / (dp if fsdp else 1)
    parts["step"] = largest_owned * _step_temporaries(setting) * (0 if offloaded else 1)
    if setting.optimizer_in_backward:   # each gradient freed by its own step, during backward
        in_flight = _gradients_in_flight(blocks, dp=dp if fsdp else 1)
        parts["activations"] += in_flight + parts["step"]
        parts["grads"] = parts["step"] = 0
    return {name: math.ceil(value) for name, value in parts.items()}, offloaded


def _step_temporaries(setting: Setting) -> float:
    """Per byte of the largest tensor: raydl's AdamW is fused on a GPU (no temporaries) and torch's per-tensor
    loop on a CPU (one of each tensor's size at a time); SGD makes none."""
    return 0.0 if setting.device_type == "cuda" else STEP_TEMPORARIES[setting.optimizer]


def _gradients_in_flight(blocks: list[BlockMemory], *, dp: int) -> float:
    """The gradients alive at once when they are stepped and freed in backward: a block's (its share of them),
    stepped together when the last is final (fully_shard reduces them into one buffer at once)."""
    return max(b.param_bytes for b in blocks) / dp


def _activations(model: ModelMemory, rank: int, stages: list[list[BlockMemory]], *, pp: int, micro_batch: int,
                 m: int, schedule: str, setting: Setting) -> float:
    per_rank = len(stages)
    in_flight = 1.0 if pp == 1 else in_flight_chunks(schedule, pp, m, rank) / per_rank
    share = BF16_ACTIVATION_SHARE if setting.precision in BF16_COMPUTE else 1.0
    total = 0.0
    for stage in stages:
        if setting.activation_checkpointing:
            kept = sum(b.output_bytes for b in stage)
            transient = max(b.activation_bytes for b in stage)
        else:
            kept, transient = sum(b.activation_bytes for b in stage), 0.0
        total += micro_batch * (in_flight * kept + transient) * share
        if stage[-1] is model.blocks[-1] and model.loss_chunk_bytes:   # the loss, chunk by chunk
            total += micro_batch * model.loss_bytes * in_flight + model.loss_chunk_bytes
        elif stage[-1] is model.blocks[-1]:   # the loss: log-probabilities kept, and their gradient in backward
            total += micro_batch * model.loss_bytes * (in_flight + 1)
    return total


_HELD = ("weights", "grads", "optimizer", "ddp buckets")        # all through the step
_DURING_STEP = ("unsharded", "casts", "activations")           # forward and backward, gone by the optimizer step


def _peak(parts: dict[str, int]) -> int:
    forward_backward = sum(parts.get(name, 0) for name in _DURING_STEP)
    return sum(parts[name] for name in _HELD) + max(forward_backward, parts["step"])


def mib(num_bytes: float) -> str:
    return f"{num_bytes / _MIB:,.0f}"


def gib(num_bytes: float) -> str:
    return f"{num_bytes / _GIB:,.2f}"
