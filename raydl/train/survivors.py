"""The survivors path of a data-parallel run under Ray: a worker that dies is replaced while the others keep
training, through torchft 0.2.0 and Ray Train's replica groups.

The driver gives Ray Train a `TorchftConfig` (raydl.driver.ray_trainer): each worker is a replica group of its
own (its torch process group has world size 1), Train's controller serves torchft's Lighthouse
(raydl.driver.survivors_backend) and, when a worker dies, Ray starts a replacement in its place without stopping
the others. Across the workers, a torchft `Manager` here runs the quorums and reconfigures a gloo (NCCL on GPU)
process group when the members change. raydl keeps its
own guarantees on top of torchft's:

  * a quorum comes before the step that needs one, synchronously (use_async_quorum=False), so a step knows who
    trains it before it takes rows: its rows (raydl.data.order, a pure function of the data position) are split
    over the live replicas and each accumulates global / (micro x live) micro-batches: the global batch stays the
    same at every size, and every row of the epoch is still taken once (torchft's DistributedSampler and its
    dynamic world size do neither);
  * a quorum is off the steady step: the members change only when one fails (its peers' all-reduce fails, and
    they take a quorum before the next step) or a replacement asks to join (it waits in its quorum until the
    others take theirs). So the others take one when a replica asks for it in the step's all-reduce, which it
    does QUORUM_EVERY_S after its last: every replica reads the same sum, so all take it before the same step;
  * one all-reduce per step sums the flattened gradients and the loss over the live replicas; a step whose
    all-reduce failed (a peer died in it) is not committed: the survivors discard it and take its rows again
    after the next quorum. No other step is redone. The commit vote is this replica's own (a replica group of one
    worker: torchft's vote would be a round trip to its own manager server that carries nothing);
  * a replica behind the others (Ray's replacement) copies a live peer in its first quorum, over the same
    process group (torchft's PGTransport): model, optimizer, grad scaler, and raydl's step and data position.
    Storage is read only when no replica has trained yet (a start, or a restart of the whole group);
  * every change of members goes on the run's record (`take_changes`, sent with the step records by the
    leading replica): the rank lost or joined, the step, the survivors' stall, the steps redone and the samples
    lost or repeated, read from the data positions on either side of the change.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass, replace
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterator

import torch
from raydl.config import JobConfig
from raydl.data.order import DataPosition
from raydl.parallel.batching import batch_split
from raydl.parallel.layout import Layout

if TYPE_CHECKING:   # its module loads FSDP (DTensor, sympy): a CPU-second of the driver, which reads only TIMEOUT here
    from raydl.train.step import StepStats

log = logging.getLogger(__name__)

LIGHTHOUSE_ENV = "TORCHFT_LIGHTHOUSE"   # Ray's _TorchftBackend sets it on every worker of a replica-group run
TIMEOUT = timedelta(seconds=30)         # collectives, peer copy, quorum: generous for a loaded machine
START_WAIT_S = 60.0                     # at a start, how long the first worker waits for the others
TORCHFT_LOGGERS = ("torchft", "torchft_quorums", "torchft_commits")   # INFO lines on every step
HEARTBEATS_PER_TIMEOUT = 10             # a worker's heartbeats to the Lighthouse per scaling.survivor_timeout_s
QUORUM_EVERY_S = 1.0                    # a steady group's quorum: how long a replacement waits for the others


def enabled() -> bool:
    """True in a worker of a run the driver started on the survivors path."""
    return bool(os.environ.get(LIGHTHOUSE_ENV))


@dataclass(frozen=True)
class Members:
    rank: int    # this replica's place among the live ones
    size: int    # live replicas this step
    ranks: frozenset[int] = frozenset()   # the live replicas' worker ranks (Ray's world ranks)


class Survivors:
    """One replica's side of the survivors path: its torchft Manager, the step's members, and its data plan.

    `state`: what a peer copies besides the model and optimizer (raydl's step, samples, data position), as the
    loop's TrainerState.to_dict(); `load_state`: takes a peer's. `make_loader(position, members)`: this
    replica's rows of every step from `position`, split over `members`."""

    def __init__(self, cfg: JobConfig, *, replica: int, workers: int, engine, optimizer: torch.optim.Optimizer,
                 scaler, make_loader: Callable[[DataPosition, Members], Any]):
        from torchft import Manager, ProcessGroupGloo, ProcessGroupNCCL
        from torchft.checkpointing.pg_transport import PGTransport

        device = engine.device
        if not log.isEnabledFor(logging.DEBUG):
            for name in TORCHFT_LOGGERS:
                logging.getLogger(name).setLevel(logging.WARNING)
            logging.getLogger("torchft.manager").addFilter(_without_flight_recorder_warning)
        self.workers = workers
        self.cfg, self.engine, self.model, self.optimizer, self.scaler = cfg, engine, engine.model, optimizer, scaler
        self.make_loader = make_loader
        self.pg = ProcessGroupNCCL(timeout=TIMEOUT) if device.type == "cuda" else ProcessGroupGloo(timeout=TIMEOUT)
        self.state: dict[str, Any] = {}
        self.healed: dict[str, Any] | None = None
        self.members: Members | None = None
        self._joined = False
        self._quorum_due = True                # a failure, or a replica asked for one in the last all-reduce
        self._last_quorum = time.monotonic()
        self._flat: torch.Tensor | None = None  # the all-reduce's buffer, kept: a new one each step costs page faults
        self._planned: tuple[Members, DataPosition] | None = None   # what the current loader serves next
        self._loader: Any = None
        self._batches: Iterator | None = None
        self._record = ChangeRecord()
        self.manager = Manager(
            pg=self.pg, load_state_dict=self._load, state_dict=self._state_dict, min_replica_size=1,
            use_async_quorum=False,   # heal and learn the members before the step takes its rows
            init_sync=False,          # every replica builds the same initial weights from train.seed
            world_size=1, rank=0, replica_id=replica_id(replica), timeout=TIMEOUT, quorum_timeout=TIMEOUT,
            heartbeat_interval=timedelta(seconds=cfg.scaling.survivor_timeout_s / HEARTBEATS_PER_TIMEOUT),
            checkpoint_transport=PGTransport(self.pg, timeout=TIMEOUT, device=device))
        self.manager._client = _ReplicaClient(self.manager._client)

    # -- what a peer sends and a newcomer loads (torchft calls these from its quorum)
    def _state_dict(self) -> dict[str, Any]:
        if self.cfg.debug.peer_copy_hold_s:
            _hold_peer_copy(self.cfg.debug.ledger_dir, self.cfg.debug.peer_copy_hold_s)
        return {"model": self.model.state_dict(), "optim": self.optimizer.state_dict(),
                "scaler": self.scaler.state_dict() if self.scaler else None, "trainer": self.state}

    def _load(self, sent: dict[str, Any]) -> None:
        self.model.load_state_dict(sent["model"])
        self.optimizer.load_state_dict(sent["optim"])
        if self.scaler and sent["scaler"]:
            self.scaler.load_state_dict(sent["scaler"])
        self.state = self.healed = sent["trainer"]

    # -- the loop's calls
    def join(self, state: dict[str, Any]) -> dict[str, Any] | None:
        """The first quorum, before anything is read from storage: a peer's state if one had trained further
        (this worker copied it), else None (every replica loads the run's checkpoint, see `start_at`). When no
        worker has trained yet (a start, or a restart of the whole group), wait for all of them to join first,
        up to START_WAIT_S: the first would otherwise train alone until the others have built their models."""
        deadline = time.monotonic() + START_WAIT_S
        self._quorum(state)
        # Again after a failed quorum too: a copy cut off (its sender died) must not leave this worker to read
        # storage while a live peer has trained further; the next quorum copies that peer, or finds none left.
        while (self.manager.errored() or (self.healed is None and self.members.size < self.workers)) \
                and time.monotonic() < deadline:
            time.sleep(0.1)   # polling the Lighthouse for the others, bounded by the deadline
            self._quorum(state)
        self._joined = True   # this quorum is also the first step's: the others are already in its all-reduce
        return self._take_healed()

    def start_at(self, state: dict[str, Any]) -> None:
        """The step this replica resumes at from storage: its quorum step from now on."""
        self.state = state
        self.manager.load_state_dict({"step": state["step"], "batches_committed": 0})

    def next_batch(self, state: dict[str, Any]):
        """The step's quorum if one is due, then this replica's rows of it: (the state to go on from, which is a
        peer's if this replica just copied one, and the batch). A change of members or position re-plans the rows."""
        if self._joined:
            self._joined = False
        elif self._quorum_due:
            self._quorum(state)
        state = self._take_healed() or self.state
        position = DataPosition(**state["position"])
        if self._planned != (self.members, position):
            self._replan(position)
        self._record.began()
        batch = next(self._batches)
        self._planned = (self.members, batch.position)
        return state, batch

    def average(self, stats: StepStats) -> StepStats | None:
        """Gradients and loss of the live replicas' whole batch, token-weighted, in one all-reduce: each replica
        computed its mean over its own targets; weighed back by its count (the sum), summed, and divided by the
        summed count, the result is the sum over every target of the step over their number (FINETUNE_NOTES).
        The same all-reduce says whether a replica wants a quorum before the next step.
        None: the step is discarded (a peer failed during it); its rows are taken again after the next quorum."""
        params = [p for p in self.model.parameters() if p.requires_grad]
        wanted = time.monotonic() - self._last_quorum >= QUORUM_EVERY_S
        flat = self._flat = weighed(params, stats, quorum_wanted=wanted, out=self._flat)
        self.manager.allreduce(flat, reduce_op=_sum_op()).wait()
        if not self.manager.should_commit():
            self._quorum_due, self._planned = True, None
            self._record.discarded()
            self.optimizer.zero_grad(set_to_none=True)
            return None
        loss, self._quorum_due = unweigh(params, flat)
        return replace(stats, loss=loss)

    def committed(self, state: dict[str, Any]) -> None:
        """The step is done: `state` is what a newcomer copies from now on."""
        self._record.committed(self.members, before=DataPosition(**self.state["position"]),
                               after=DataPosition(**state["position"]), step=state["step"],
                               steps_per_epoch=self._loader.steps_per_epoch,
                               global_batch=self.cfg.train.global_batch_size)
        self.state = state

    def take_changes(self) -> list[dict[str, Any]]:
        """The changes of members since the last call (`ChangeRecord`), for the step records."""
        return self._record.take()

    def all_reduce_sum(self, t: torch.Tensor) -> None:
        """Sum over the live replicas (raydl.train.agree's one collective at a report); a peer lost during it
        leaves this replica's own values (the next quorum goes on without it)."""
        local = t.clone()
        self.manager.allreduce(t, reduce_op=_sum_op()).wait()
        if self.manager.errored():
            t.copy_(local)
            self._quorum_due = True

    @property
    def leads(self) -> bool:
        """The first live replica sends the run's step records (any worker may be the one that died)."""
        return self.members is not None and self.members.rank == 0

    def layout(self, live: int) -> Layout:
        """The engine's layout at `live` replicas: the same global batch, split over them (raydl.parallel.recovery
        checked that it splits exactly at every size)."""
        micro, m = batch_split(global_batch=self.cfg.train.global_batch_size,
                               micro_batch=self.cfg.train.micro_batch_size, dp=live, strict=True)
        return replace(self.engine.layout, world_size=live, dp=live, micro_batch=micro, num_microbatches=m)

    def close(self) -> None:
        if self._batches is not None:
            self._batches.close()
        self.manager.shutdown(wait=False)

    # -- inside
    def _quorum(self, state: dict[str, Any]) -> None:
        self.state = state
        self.manager.start_quorum()   # synchronous: reconfigures the group and copies a peer if behind
        self._last_quorum, self._quorum_due = time.monotonic(), False
        rank, size = self.manager.participating_rank(), self.manager.num_participants()
        self.members = Members(rank, size, frozenset(self.manager._client.ranks))

    def _take_healed(self) -> dict[str, Any] | None:
        healed, self.healed = self.healed, None
        if healed is not None:
            log.info(f"copied a live peer at step {healed['step']}")
        return healed

    def _replan(self, position: DataPosition) -> None:
        if self._batches is not None:
            self._batches.close()     # stops its read-ahead thread
        self.engine.layout = self.layout(self.members.size)
        self._loader = self.make_loader(position, self.members)
        self._batches = iter(self._loader)


class ChangeRecord:
    """The changes of a replica's members as it saw them, one entry per rank lost or joined:

      step              the first step the new members trained (the loss or join took effect before it)
      time              when that step was committed (wall clock)
      stall_s           from the end of the last step committed by the old members to the start of the first one
                        by the new (the step discarded at a loss, the quorum's wait for a silent worker, a peer copy)
      steps_redone      steps discarded in between (a peer failed during them), whose rows were taken again
      samples_lost, samples_repeated   rows skipped or taken twice: where the first step after the change took
                        its rows from, against where the last one before it ended (raydl's data order)
    """

    def __init__(self):
        self.changes: list[dict[str, Any]] = []
        self._ranks: frozenset[int] | None = None   # who trained the last committed step
        self._committed_at: float | None = None
        self._began_at = 0.0
        self._discarded = 0

    def began(self) -> None:
        """A step starts: its quorum done, its rows planned."""
        self._began_at = time.time()

    def discarded(self) -> None:
        self._discarded += 1

    def committed(self, members: Members, *, before: DataPosition, after: DataPosition, step: int,
                  steps_per_epoch: int, global_batch: int) -> None:
        """A step ended at `after`, committed by `members`; the one before it ended at `before`."""
        if self._ranks is not None and members.ranks != self._ranks:
            skipped = (_step_index(after, steps_per_epoch, global_batch) - 1
                       - _step_index(before, steps_per_epoch, global_batch))
            common = {"step": step, "time": time.time(), "workers": members.size,
                      "stall_s": round(self._began_at - self._committed_at, 3), "steps_redone": self._discarded,
                      "samples_lost": max(skipped, 0) * global_batch,
                      "samples_repeated": max(-skipped, 0) * global_batch}
            self.changes += [{"event": "lost", "rank": rank, **common} for rank in sorted(self._ranks - members.ranks)]
            self.changes += [{"event": "joined", "rank": rank, **common}
                             for rank in sorted(members.ranks - self._ranks)]
        self._ranks, self._committed_at, self._discarded = members.ranks, time.time(), 0

    def take(self) -> list[dict[str, Any]]:
        changes, self.changes = self.changes, []
        return changes


def _step_index(position: DataPosition, steps_per_epoch: int, global_batch: int) -> int:
    """The steps of the run's data order up to `position` (every epoch has steps_per_epoch of them)."""
    return position.epoch * steps_per_epoch + position.offset // global_batch


class _ReplicaClient:
    """torchft's ManagerClient of a replica group of one worker: it keeps the worker ranks of the last quorum's
    members (their replica ids end in the rank: `replica_id`), which torchft's Manager reads and drops, and answers
    the commit vote itself (torchft's would be a barrier of this one worker, through its manager server)."""

    def __init__(self, client):
        self.client, self.ranks = client, ()

    def _quorum(self, **kwargs):
        from torchft.manager import extract_trailing_digits

        quorum = self.client._quorum(**kwargs)
        self.ranks = tuple(extract_trailing_digits(member.split(":")[0]) for member in quorum.replica_ids)
        return quorum

    def should_commit(self, group_rank: int, step: int, should_commit: bool, timeout: timedelta) -> bool:
        return should_commit

    def __getattr__(self, name: str):
        return getattr(self.client, name)


def weighed(params: list[torch.nn.Parameter], stats: StepStats, *, quorum_wanted: bool = False,
            out: torch.Tensor | None = None) -> torch.Tensor:
    """What a replica sends to the sum: its gradients and loss (means over its own targets) times its count of
    targets, that count, and 1 if it wants a quorum before the next step. Into `out` when it has the size."""
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    device, dtype = params[0].device, params[0].grad.dtype
    count = torch.as_tensor(stats.count, dtype=dtype, device=device).reshape(1)
    tail = torch.stack([torch.as_tensor(stats.loss, dtype=dtype, device=device).reshape(()),
                        torch.ones((), dtype=dtype, device=device),
                        torch.full((), float(quorum_wanted), dtype=dtype, device=device)])
    parts = [*(p.grad.reshape(-1) for p in params), tail]
    size = sum(part.numel() for part in parts)
    if out is None or out.numel() != size or out.dtype != dtype or out.device != device:
        out = torch.empty(size, dtype=dtype, device=device)
    torch.cat(parts, out=out)
    out[:-1].mul_(count.clamp(min=1))
    return out


def unweigh(params: list[torch.nn.Parameter], summed: torch.Tensor) -> tuple[torch.Tensor, bool]:
    """The replicas' sum of `weighed`, divided by their summed count: gradients into `params`; returns the loss and
    whether a replica wants a quorum before the next step."""
    count = summed[-2].clone().clamp(min=torch.finfo(summed.dtype).tiny)   # no targets: all zero
    summed[:-2].div_(count)
    for p, g in zip(params, summed[:-3].split([p.numel() for p in params])):
        p.grad.copy_(g.view_as(p.grad))
    return summed[-3].clone(), bool(summed[-1] > 0)   # a view would keep the buffer until the report reads the loss


def _hold_peer_copy(ledger_dir: str, seconds: float) -> None:
    """debug.peer_copy_hold_s: the copy marked in the ledger directory and held open, for a test to kill a worker
    while a replacement catches up."""
    Path(ledger_dir, f"peer-copy-{os.getpid()}").touch()
    time.sleep(seconds)


def _without_flight_recorder_warning(record: logging.LogRecord) -> bool:
    """torchft warns at every change of members that it cannot reset NCCL's flight recorder, on every torch
    build without one (CPU): a line on the user's console that says nothing about their run."""
    return "flight recorder" not in record.getMessage()


def replica_id(rank: int) -> str:
    """The Lighthouse ranks a quorum's members by id: starting with the start time, the longest-lived replica
    is the first, which sends the step records (`leads`). A newcomer leading would drop the steps the others
    trained since their last report; the ones a dead leader had not reported are the next leader's to send.
    torchft reads the worker's rank from the id's trailing digits."""
    return f"raydl_{time.time_ns():020d}_{rank}"


def _sum_op():
    from torch.distributed import ReduceOp

    return ReduceOp.SUM
