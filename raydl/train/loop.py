"""The per-worker training loop, the same under Ray Train and under torchrun.

    torchrun --nproc-per-node 2 -m raydl.worker --config my.yaml      # no Ray needed
    raydl train --config my.yaml                                       # Ray Train runs train_worker

Every worker-group start (first start, restart after a failure, resize) runs this from the
top: read the world size, choose the layout, build the model for it, load the latest
checkpoint into that layout, and continue the data sequence where the checkpoint left it.
"""

from __future__ import annotations

import math
import os
import time
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from raydl.overrides import build_config
from raydl.data.dataset import check_task, open_dataset
from raydl.data.loader import StepLoader, eval_batches
from raydl.data.order import DataPosition
from raydl.models.blocks import num_params
from raydl.models.registry import get_spec
from raydl.parallel.engine import build_engine
from raydl.telemetry.step_clock import StepClock, peak_flops, peak_memory_mb
from raydl.telemetry.nvml import GpuMonitor
from raydl.train import checkpoint as ckpt
from raydl.train.optim import build_optimizer, lr_at, set_lr
from raydl.train.precision import make_scaler
from raydl.train.session import RaySession, TorchrunSession, in_ray
from raydl.train.step import optimizer_step


@dataclass
class TrainerState:
    step: int = 0
    samples: int = 0
    position: DataPosition = DataPosition()

    def to_dict(self) -> dict[str, Any]:
        return {"step": self.step, "samples": self.samples, "position": self.position.to_dict()}


def seed_step(seed: int, step: int, rank: int) -> None:
    """RNG as a pure function of (seed, step, rank): restarts replay it exactly, with no saved RNG state."""
    torch.manual_seed((seed * 1_000_003 + step) * 1_009 + rank)


def restore(session, job: dict, engine, optimizer, scaler, fingerprint) -> TrainerState:
    with session.latest_checkpoint() as path:
        path = path or job.get("resume_from")
        if not path:
            return TrainerState()
        saved = ckpt.load(path, engine.model, optimizer, fingerprint)
    if scaler and saved.get("scaler"):
        scaler.load_state_dict(saved["scaler"])
    if session.rank == 0:
        print(f"[raydl] resumed from {path} at step {saved['step']}", flush=True)
    return TrainerState(saved["step"], saved["samples"], DataPosition(**saved["position"]))


def mean_over_loss_ranks(values: list[float], has_loss: bool, device: torch.device) -> list[float]:
    """Average per-step losses over the ranks that computed one (all of DP; the last stage of PP)."""
    t = torch.tensor([v if has_loss else 0.0 for v in values] + [float(has_loss)], dtype=torch.float64, device=device)
    dist.all_reduce(t)
    return (t[:-1] / t[-1]).tolist()


def train_worker(job: dict[str, Any]) -> dict[str, Any]:
    t_start = time.time()
    cfg = build_config(job["config"])
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    session = RaySession() if in_ray() else TorchrunSession(job["run_dir"], cfg.checkpoint.keep)
    spec = get_spec(cfg.model)
    info = open_dataset(job["data_path"])
    check_task(info, spec.task, spec.name)

    torch.manual_seed(cfg.train.seed)        # identical initial weights on every rank
    model = spec.build(cfg.model, info.meta)
    fingerprint = {"name": cfg.model.name, "size": cfg.model.size, "params": num_params(model),
                   "blocks": len(model.blocks)}
    engine = build_engine(model, cfg, spec, session)
    layout = engine.layout
    optimizer = build_optimizer(engine.parameters(), cfg.train)
    scaler = make_scaler(cfg.train.precision, session.device)
    state = restore(session, job, engine, optimizer, scaler, fingerprint)

    dp_rank = layout.coords(session.rank)[0]
    loader = StepLoader(info, global_batch=layout.global_batch, dp_rank=dp_rank, dp_size=layout.dp,
                        seed=cfg.train.seed, shuffle=cfg.data.shuffle, position=state.position,
                        prefetch=cfg.data.prefetch_batches, max_bad_shards=cfg.data.max_bad_shards,
                        backend=cfg.data.backend, augment=cfg.data.augment, read_cpus=cfg.data.read_cpus)
    total_steps = cfg.train.max_steps or cfg.train.max_epochs * loader.steps_per_epoch
    gpu = GpuMonitor(session.device.index if session.device.type == "cuda" and cfg.telemetry.nvml else None)
    clock = StepClock(first_step=state.step + 1, peak_flops_total=peak_flops(session.device) * session.world_size)
    units, flops = spec.units_per_sample(info.meta), spec.flops_per_sample(cfg.model, info.meta)
    if session.rank == 0:
        print(f"[raydl] world size {session.world_size}: layout {layout.to_dict()}, starting at step {state.step}, "
              f"{fingerprint['params'] / 1e6:.2f}M params", flush=True)

    def save(path: str) -> None:
        ckpt.save(path, engine.model, optimizer, {**state.to_dict(), "model": fingerprint, "layout": layout.to_dict(),
                                                  "scaler": scaler.state_dict() if scaler else None,
                                                  "lr": lr_at(state.step, cfg.train, total_steps),
                                                  "saved_by_ranks": session.world_size}, rank=session.rank)

    def evaluate() -> dict[str, float]:
        return engine.evaluate(eval_batches(info, batch=layout.micro_batch, dp_rank=dp_rank, dp_size=layout.dp,
                                            max_batches=cfg.train.eval_batches, max_bad_shards=cfg.data.max_bad_shards),
                               precision=cfg.train.precision)

    batches, saved_on_notice = iter(loader), False
    while state.step < total_steps:
        batch = next(batches)
        seed_step(cfg.train.seed, state.step, session.rank)
        lr = lr_at(state.step, cfg.train, total_steps)
        set_lr(optimizer, lr)
        stats = engine.forward_backward(batch.tensors, scaler=scaler)
        grad_norm = optimizer_step(optimizer, scaler, clip=engine.clip(cfg.train.grad_clip))
        state = TrainerState(state.step + 1, state.samples + layout.global_batch, batch.position)
        clock.record(step=state.step, epoch=batch.position.epoch, loss=stats.loss, lr=lr, grad_norm=grad_norm,
                     data_wait_s=batch.wait_s, bad_shards=batch.bad_shards, samples=layout.global_batch,
                     units_per_sample=units, flops_per_sample=flops,
                     world_size=session.world_size, peak_memory_mb=peak_memory_mb(session.device),
                     time=time.time(), **gpu.read())
        if cfg.train.eval_every and state.step % cfg.train.eval_every == 0 and state.step < total_steps:
            t_eval = time.perf_counter()   # eval_s lets readers take eval time out of the next step's step_s
            clock.annotate(eval_loss=evaluate()["loss"], eval_s=time.perf_counter() - t_eval)
        checkpoint_due = state.step % cfg.checkpoint.every_steps == 0 or state.step == total_steps
        if checkpoint_due or state.step % cfg.telemetry.report_every == 0:
            # Checked only at reports: it is a barrier, and a drain deadline is seconds away, not steps.
            if not saved_on_notice and session.preemption_notice():
                checkpoint_due = saved_on_notice = True   # save now; Ray restarts the group smaller later
            report(session, clock, stats.has_loss, layout, total_steps, checkpoint=save if checkpoint_due else None,
                   step=state.step, preempted=saved_on_notice)
            if saved_on_notice:
                session.wait_for_restart()

    result = evaluate()
    final = {"samples": state.samples, "eval": result, "precision": cfg.train.precision,
             "wall_s": time.time() - t_start, "steps": state.step}
    session.report({"records": [], "final": True, "final_info": final})
    session.close()
    return final


def report(session, clock: StepClock, has_loss: bool, layout, total_steps: int, *, checkpoint, step: int,
           preempted: bool = False) -> None:
    """Report the steps since the last report (a barrier on every rank); with a checkpoint if due."""
    records = clock.drain()
    for r, loss in zip(records, mean_over_loss_ranks([r["loss"] for r in records], has_loss, session.device)):
        r["loss"] = loss
        if not math.isfinite(loss):   # every rank sees the same mean, so all ranks stop here together
            raise FloatingPointError(f"training diverged: loss is {loss} at step {r['step']} (lr {r['lr']:.3g}). "
                                     "Fix: lower train.lr, raise train.warmup_steps, or use bf16 instead of fp16")
    metrics = {"records": records if session.rank == 0 else [], "layout": layout.to_dict(),
               "total_steps": total_steps, "step": step, "group_start": records[0]["step"] == clock.first_step,
               "preempted": preempted}
    if checkpoint:
        session.save_and_report(step, metrics, checkpoint)
    else:
        session.report(metrics)

