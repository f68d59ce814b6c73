"""The per-worker training loop, the same under Ray Train and under torchrun.

    torchrun --nproc-per-node 2 -m raydl.worker --config my.yaml      # no Ray needed
    raydl train --config my.yaml                                       # Ray Train runs train_worker

Every worker-group start (first start, restart after a failure, resize) runs this from the
top: read the world size, choose the layout, build the model for it, load the latest
checkpoint into that layout, and continue the data sequence where the checkpoint left it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import os
import time
import traceback
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from raydl import log as raydl_log
from raydl import storage
from raydl.config import JobConfig
from raydl.data.dataset import open_dataset
from raydl.data.ledger import Ledger
from raydl.data.loader import StepLoader, epoch_steps, eval_batches
from raydl.data.order import DataPosition
from raydl.metrics import trackers
from raydl.metrics.tensorboard import events_dir
from raydl.errors import RaydlError, TrainingDivergedError, is_out_of_memory, out_of_memory
from raydl.models.choice import choose_model
from raydl.models.registry import search_from
from raydl.overrides import build_config
from raydl.parallel.layout import describe
from raydl.parallel.recovery import RecoveryPath
from raydl.telemetry.nvml import GpuMonitor
from raydl.telemetry.profiler import StepProfiler, phase
from raydl.telemetry import startup
from raydl.telemetry.records import FinalInfo, WorkerReport
from raydl.telemetry.memory_marks import MemoryMarks
from raydl.telemetry.step_clock import StepClock, peak_flops
from raydl.train import checkpoint as ckpt
from raydl.train.checkpoint_state import saving_ranks
from raydl.train.agree import Agreed, agree
from raydl.train.engines import build_engine
from raydl.train.hold import hold_after
from raydl.train.host_memory import cap_growth, return_large_blocks, threshold_for
from raydl.train.memory_state import GroupStart, MemoryKeeper, begin_group
from raydl.train.model_build import build_for_worker
from raydl.train.optim import build_optimizer, lr_at, set_lr
from raydl.train.precision import make_scaler
from raydl.train.session import RaySession, TorchrunSession, in_ray
from raydl.train.step import optimizer_step
from raydl.train.survivors import Survivors

NO_SURVIVORS = {"survivors": False, "why": "not started by raydl's Ray driver"}

IMPORTS_DONE = time.time()   # a start-up mark: the worker's raydl and torch imports end here

log = logging.getLogger(__name__)


@dataclass
class TrainerState:
    step: int = 0
    samples: int = 0
    position: DataPosition = DataPosition()

    def to_dict(self) -> dict[str, Any]:
        return {"step": self.step, "samples": self.samples, "position": self.position.to_dict()}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "TrainerState":
        return cls(d["step"], d["samples"], DataPosition(**d["position"]))


def seed_step(seed: int, step: int, rank: int) -> None:
    """RNG as a pure function of (seed, step, rank): restarts replay it exactly, with no saved RNG state."""
    torch.manual_seed((seed * 1_000_003 + step) * 1_009 + rank)


def restore(session, job: dict, engine, optimizer, scaler, fingerprint, held: GroupStart | None) -> TrainerState:
    """The state to start from: the state holder's (restart from memory) when newer than storage's newest
    checkpoint, else that checkpoint (or --resume's, or nothing)."""
    if held and held.newer_than(session.newest_checkpoint_step()):
        saved = held.load(session.rank, engine.model, optimizer, scaler)
        if session.rank == 0:
            session.announce(f"resumed from memory at step {saved['step']} (held by the run's state holder; "
                             f"the newest storage checkpoint is older)")
        return TrainerState(saved["step"], saved["samples"], DataPosition(**saved["position"]))
    with session.latest_checkpoint() as path:
        path = path or job.get("resume_from")
        # A new run from trained weights starts at step 0 with its own data and optimizer; a LoRA run's checkpoints
        # hold its adapters alone, so its base weights are read from train.init_from at every start.
        if job.get("init_from") and (not path or job.get("lora_fingerprint")):
            ckpt.load_weights(job["init_from"], engine.model)
            if session.rank == 0 and not path:
                session.announce(f"initialised the weights from {job['init_from']} (train.init_from)")
        if not path:
            return TrainerState()
        saved = ckpt.load(path, engine.model, optimizer, fingerprint)
    if scaler and saved.get("scaler"):
        scaler.load_state_dict(saved["scaler"])
    if session.rank == 0:
        session.announce(f"resumed from {path} at step {saved['step']}")
    return TrainerState.from_dict(saved)


@dataclass
class Worker:
    """What one worker-group start builds: the model laid out, its optimizer, data and clocks."""

    job: dict[str, Any]
    cfg: JobConfig
    session: Any
    spec: Any
    info: Any
    engine: Any
    optimizer: torch.optim.Optimizer
    scaler: Any
    loader: StepLoader | None    # None on the survivors path: raydl.train.survivors plans the rows step by step
    clock: StepClock
    gpu: GpuMonitor
    fingerprint: dict[str, Any]
    total_steps: int
    last_checkpoint_step: int = 0
    last_finite_loss: tuple[int, float] | None = None
    keeper: MemoryKeeper | None = None   # restart from memory (checkpoint.memory_every_steps), under Ray
    marks: startup.Marks = dataclasses.field(default_factory=startup.Marks)   # this start's, up to its data
    memory: MemoryMarks = dataclasses.field(default_factory=MemoryMarks)   # debug.memory_dir's peaks
    survivors: Survivors | None = None   # the survivors path (raydl.parallel.recovery): this replica's Manager

    @property
    def leads(self) -> bool:
        """Whether this worker sends the run's step records: rank 0, or on the survivors path the first live one."""
        return self.survivors.leads if self.survivors else self.session.rank == 0

    @property
    def dp_rank(self) -> int:
        return self.engine.layout.coords(self.session.rank)[0]


def start_worker(job: dict[str, Any], session=None) -> tuple[Worker, TrainerState]:
    """`session`: where this worker runs (a sweep trial passes its own); default: Ray Train's, else torchrun's."""
    raydl_log.ensure_configured()   # a Ray worker process: the driver's verbosity came in RAYDL_VERBOSITY
    raydl_log.quiet_exits_in_callbacks()   # Ray ends its workers with SIGTERM
    marks = startup.Marks(worker_process_start=startup.process_start_time() or IMPORTS_DONE,
                          worker_imports_done=IMPORTS_DONE)
    cfg = build_config(job["config"])
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    if session is None:
        session = (RaySession(job["metrics_sink"], tune_reports=job.get("tune_reports", False),
                              survivors=job.get("recovery", NO_SURVIVORS)["survivors"], keep=cfg.checkpoint.keep,
                              checkpoints_at=storage.join(*storage.run_checkpoints(
                                  cfg.checkpoint.storage_path, job["run_dir"], job["run_id"]))) if in_ray() else
                   TorchrunSession(job["run_dir"], cfg.checkpoint.keep,
                                   cfg.telemetry.progress, events_dir(cfg, job), trackers.settings_for(cfg, job),
                                   storage_path=cfg.checkpoint.storage_path, run_id=job["run_id"]))
    marks.mark("process_group_ready")   # Ray Train sets it up before the train function; torchrun's session here
    search_from(job.get("import_dir", ""))     # where the driver imported model.name from
    chosen = choose_model(cfg.model, job.get("model"))
    spec = chosen.spec
    info = open_dataset(job["data_path"])
    chosen.check_data(info)
    memory = MemoryMarks(cfg.debug.memory_dir, session.device)
    memory.mark("start")
    cap_growth(cfg.debug.memory_limit_mb)
    model, init = build_for_worker(chosen, info.meta, cfg)   # on meta: allocated once laid out
    memory.mark("meta")
    fingerprint = {**chosen.fingerprint(model), **job.get("lora_fingerprint", {})}   # before LoRA, as the driver's
    path = RecoveryPath(**job.get("recovery", NO_SURVIVORS))
    engine = build_engine(model, cfg, spec, session, info.meta, init, survivors=path.survivors)
    marks.mark("model_built")
    layout = engine.layout
    return_large_blocks(threshold_for(cfg.train.host_mmap_threshold_kib, wrapper=layout.dp_wrapper, pp=layout.pp,
                                      cpu_offload=cfg.train.cpu_offload))
    optimizer = build_optimizer(engine.parameters(), cfg.train)
    if cfg.train.optimizer_in_backward:
        engine.step_in_backward(optimizer)
    scaler = make_scaler(cfg.train.precision, session.device)
    memory.mark("built", layout=engine.layout.to_dict(), coords=engine.layout.coords(session.rank))
    total_steps = cfg.train.max_steps or cfg.train.max_epochs * epoch_steps(info, layout.global_batch)

    def open_loader(position: DataPosition, dp_rank: int, dp_size: int, step: int) -> StepLoader:
        return StepLoader(info, global_batch=layout.global_batch, dp_rank=dp_rank, dp_size=dp_size,
                          seed=cfg.train.seed, shuffle=cfg.data.shuffle, position=position,
                          prefetch=cfg.data.prefetch_batches, max_bad_shards=cfg.data.max_bad_shards,
                          backend=cfg.data.backend, augment=cfg.data.augment, read_cpus=cfg.data.read_cpus,
                          ledger=Ledger.from_config(cfg.debug), steps=max(0, total_steps - step))

    survivors, loader, copied, keeper = None, None, None, None
    if path.survivors:
        survivors = Survivors(cfg, replica=session.rank, workers=session.world_size, engine=engine,
                              optimizer=optimizer, scaler=scaler,
                              make_loader=lambda position, members: open_loader(
                                  position, members.rank, members.size, survivors.state["step"]))
        copied = survivors.join(TrainerState().to_dict())   # a live peer's state, before any storage read
    if copied:
        state = TrainerState.from_dict(copied)
    else:
        holder, every_held = job.get("state_holder"), cfg.checkpoint.memory_every_steps   # none on the survivors path
        held = begin_group(holder, session.rank, layout.to_dict()) if holder and every_held else None
        state = restore(session, job, engine, optimizer, scaler, fingerprint, held)
        keeper = MemoryKeeper(held, rank=session.rank, layout=layout.to_dict(), every=every_held) if held else None
        if survivors:
            survivors.start_at(state.to_dict())
        else:
            loader = open_loader(state.position, layout.coords(session.rank)[0], layout.dp, state.step)
    marks.mark("data_open")
    clock = StepClock(first_step=state.step + 1, peak_flops_total=peak_flops(session.device) * session.world_size,
                      units_per_sample=spec.units_per_sample(info.meta),
                      flops_per_sample=chosen.flops_per_sample(info.meta) or 0.0)   # 0 = unknown
    gpu = GpuMonitor(session.device.index if session.device.type == "cuda" and cfg.telemetry.nvml else None)
    if session.rank == 0 and not copied:
        session.announce(f"{describe(layout, start_step=state.step, num_params=fingerprint['params'])}; "
                         f"{path.describe()}")
    if copied:
        session.announce(f"worker {session.rank} joined the others at step {state.step}: copied a live peer")
        clock.first_step = -1   # not a worker-group start: the others never stopped
    return Worker(job, cfg, session, spec, info, engine, optimizer, scaler, loader, clock, gpu, fingerprint,
                  total_steps, last_checkpoint_step=state.step, keeper=keeper, marks=marks, memory=memory,
                  survivors=survivors), state


def train_worker(job: dict[str, Any], session=None) -> dict[str, Any]:
    t_start = time.time()
    with memory_errors(job, "building and loading its model"):
        w, state = start_worker(job, session)
    try:
        with memory_errors(job, "training"):
            state, stopped_by = fit(w, state)
            final = FinalInfo(samples=state.samples, steps=state.step, eval={} if stopped_by else evaluate(w),
                              precision=w.cfg.train.precision, wall_s=time.time() - t_start,
                              stopped_by_signal=stopped_by,
                              compile=w.engine.compiled.to_dict() if w.engine.compiled else None)
        w.memory.mark("end")
        w.session.report(WorkerReport(records=[], layout=w.engine.layout.to_dict(), total_steps=w.total_steps,
                                      step=state.step, final=final))
    except Exception as e:
        if w.survivors:   # Ray's controller may be waiting to place a replacement, blind to this worker's error
            w.session.failed(e)
        raise
    w.gpu.close()
    if w.keeper:
        w.keeper.close()
    if w.survivors:
        w.survivors.close()
    w.session.close()
    return dataclasses.asdict(final)


@contextlib.contextmanager
def memory_errors(job: dict[str, Any], during: str) -> Iterator[None]:
    """An allocation failure becomes raydl's paragraph (exit 1, no retry: the same layout would fail again)."""
    try:
        yield
    except Exception as e:
        if not is_out_of_memory(e) or isinstance(e, RaydlError):
            raise
        traceback.clear_frames(e.__traceback__)   # what the failed frames held (a half-built model) goes now
        rank = dist.get_rank() if dist.is_initialized() else 0
        raise out_of_memory(e, rank=rank, during=during,
                            limit_mb=job["config"].get("debug", {}).get("memory_limit_mb", 0)) from e


def fit(w: Worker, state: TrainerState) -> tuple[TrainerState, int]:
    """The training loop: one optimizer step per global batch, reports and checkpoints at their intervals.
    Returns the state and the signal that stopped it early (0 = ran to the end)."""
    cfg, layout = w.cfg, w.engine.layout
    batches, saved_on_notice = iter(w.loader) if w.loader else None, False
    profiler = StepProfiler(cfg.telemetry.profile_steps, first_step=state.step + 1, last_step=w.total_steps,
                            run_dir=w.job["run_dir"], session=w.session, layout=layout)
    while state.step < w.total_steps:
        w.clock.begin()
        profiler.begin(state.step + 1)
        with phase("data_wait"):
            if w.survivors:   # the step's quorum first: who is alive decides which rows this replica takes
                copied, batch = w.survivors.next_batch(state.to_dict())
                state = TrainerState.from_dict(copied)
            else:
                batch = next(batches)
        seed_step(cfg.train.seed, state.step, w.session.rank)
        lr = lr_at(state.step, cfg.train, w.total_steps)
        set_lr(w.optimizer, lr)
        with phase("forward_backward"):
            stats = w.engine.forward_backward(batch.tensors, scaler=w.scaler)
        if w.engine.compiled and w.engine.compiled.first_step_pending:
            w.marks.mark("compiled")   # the first forward and backward compiled the blocks
            w.engine.compiled.first_step_done()
        if w.survivors and (stats := w.survivors.average(stats)) is None:
            continue   # a peer failed during the step: discarded, its rows taken again after the next quorum
        with phase("optimizer"):
            grad_norm = optimizer_step(w.optimizer, w.scaler, clip=w.engine.clip(cfg.train.grad_clip))
        state = TrainerState(state.step + 1, state.samples + layout.global_batch, batch.position)
        if w.keeper:
            w.keeper.after_step(state.to_dict(), w.engine.model, w.optimizer, w.scaler)
        if w.survivors:
            w.survivors.committed(state.to_dict())
        record = w.clock.record(step=state.step, epoch=batch.position.epoch, loss=stats.loss, lr=lr,
                                grad_norm=grad_norm, samples=layout.global_batch,
                                world_size=w.engine.layout.world_size if w.survivors else w.session.world_size,
                                data_wait_s=batch.wait_s, bad_shards=batch.bad_shards, device=w.session.device,
                                gpu=w.gpu.read())
        if w.survivors:
            record.members = w.survivors.take_changes() or None
        profiler.end(state.step)
        if cfg.train.eval_every and state.step % cfg.train.eval_every == 0 and state.step < w.total_steps:
            t_eval = time.perf_counter()
            record.eval_loss, record.eval_s = evaluate(w)["loss"], time.perf_counter() - t_eval
        checkpoint_due = state.step % cfg.checkpoint.every_steps == 0 or state.step == w.total_steps
        if checkpoint_due or state.step % cfg.telemetry.report_every == 0:
            t_report = time.perf_counter()
            agreed = report(w, state, stats.has_loss, checkpoint_due=checkpoint_due, saved_on_notice=saved_on_notice)
            w.clock.spend("checkpoint" if w.last_checkpoint_step == state.step else "report",
                          time.perf_counter() - t_report)
            if agreed.preempted and not saved_on_notice:
                saved_on_notice = True
                w.session.wait_for_restart()   # Ray restarts the group smaller, from the checkpoint just saved
            if agreed.stop_signum:
                return state, agreed.stop_signum
        hold_after(state.step, cfg.debug, w.session.preemption_notice)
    return state, 0


def evaluate(w: Worker) -> dict[str, float]:
    layout, data = w.engine.layout, w.cfg.data
    # On the survivors path each replica evaluates on its own (its torch group is itself).
    dp_rank, dp_size = (0, 1) if w.survivors else (w.dp_rank, layout.dp)
    batches = eval_batches(w.info, batch=layout.micro_batch, dp_rank=dp_rank, dp_size=dp_size,
                           max_batches=w.cfg.train.eval_batches, max_bad_shards=data.max_bad_shards)
    result = w.engine.evaluate(batches, precision=w.cfg.train.precision)
    # The loss is the cross-entropy of the target tokens alone (labels -100 are no targets): its exp is their
    # perplexity, what a fine-tuning run's answers are judged by.
    result["perplexity"] = math.exp(min(result["loss"], 700.0)) if result.get("batches") else None
    return result


def save_checkpoint(w: Worker, state: TrainerState, path: str) -> None:
    if w.survivors and not w.leads:
        return   # replicas hold the same state: the leader writes the whole checkpoint (its torch group is itself)
    layout = w.engine.layout.to_dict()
    extra = {"model": w.fingerprint, "layout": layout, "scaler": w.scaler.state_dict() if w.scaler else None,
             "lr": lr_at(state.step, w.cfg.train, w.total_steps), "saved_by_ranks": saving_ranks(layout)}
    ckpt.save(path, w.engine.model, w.optimizer, {**state.to_dict(), **extra},
              rank=0 if w.survivors else w.session.rank)   # the leader's torch group is itself: it is rank 0 there
    w.last_checkpoint_step = state.step


def report(w: Worker, state: TrainerState, has_loss: bool, *, checkpoint_due: bool,
           saved_on_notice: bool) -> Agreed:
    """Agree with the other ranks on the steps' losses and on the signals (one collective), then send the steps
    since the last report, with a checkpoint if one is due, asked for (a stop), or a drain notice's first."""
    records = w.clock.drain()
    group_start = records[0].step == w.clock.first_step
    if group_start:
        records[0].startup = startup.worker_group_marks(w.marks, records[0], w.session.device,
                                                        w.session.controller_start() if w.leads else None)
    # On the survivors path each step's loss is already the mean over its replicas (its all-reduce), and a
    # replica that joined since the last report holds fewer records: only the signals are agreed on.
    losses = [r.loss for r in records]
    agreed = agree([] if w.survivors else losses, has_loss,
                   stop_signum=w.session.stop_signal(w.job.get("stop_actor"), asks=w.leads),
                   preempted=w.session.preemption_notice(), device=w.session.device,
                   all_reduce=w.survivors.all_reduce_sum if w.survivors else None)
    for r, loss in zip(records, losses if w.survivors else agreed.losses):
        r.loss = loss
        if not math.isfinite(loss):   # every rank sees the same mean, so all ranks stop here together
            raise TrainingDivergedError(step=r.step, loss=loss, lr=r.lr, last_finite=w.last_finite_loss,
                                   checkpoint_step=w.last_checkpoint_step, run_dir=w.job["run_dir"],
                                   grad_clip=w.cfg.train.grad_clip, precision=w.cfg.train.precision)
        w.last_finite_loss = (r.step, loss)
    preempted = agreed.preempted and not saved_on_notice   # the notice's checkpoint: the group's last
    w.session.leader = w.leads
    message = WorkerReport(records=records if w.leads else [], layout=w.engine.layout.to_dict(),
                           total_steps=w.total_steps, step=state.step,
                           group_start=group_start, preempted=preempted,
                           device=torch.cuda.get_device_name(w.session.device) if w.session.device.type == "cuda"
                           else "cpu")   # the driver prices device-hours by it
    # Smaller than its group, the survivors path cannot go through Ray's report (a barrier of every worker, which a
    # replacement still starting would not reach before the survivors' quorum times out): the leader writes the
    # checkpoints alone until the group is whole again.
    smaller = w.survivors is not None and w.survivors.members.size < w.session.world_size
    if smaller and w.leads and (checkpoint_due or agreed.stop_signum):
        w.session.save_alone(state.step, message, lambda path: save_checkpoint(w, state, path))
    elif not smaller and (checkpoint_due or preempted or agreed.stop_signum):
        w.session.save_and_report(state.step, message, lambda path: save_checkpoint(w, state, path))
    else:
        w.session.report(message, whole=not smaller)
    return agreed
