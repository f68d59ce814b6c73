"""What the ranks agree on at a report, in one all-reduce: each step's mean loss and the signals any rank saw.

The stop request (Ctrl-C/SIGTERM at the driver, or torchrun's forwarded signal) and a node's preemption
notice are read without waiting on any rank; this one collective, which the divergence check makes anyway,
gives every rank the same answer at the same step, so all of them checkpoint or stop together.
"""

from __future__ import annotations

import signal
from dataclasses import dataclass
from typing import Callable

import torch
import torch.distributed as dist

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)   # in order of precedence when ranks saw different ones


@dataclass(frozen=True)
class Agreed:
    losses: list[float]   # per step: the mean over the ranks that computed a loss (all of DP; PP's last stage)
    stop_signum: int      # the signal that asks the run to stop with a checkpoint; 0 = none
    preempted: bool       # a node of this worker group got a drain/preemption notice


def agree(losses: list[float], has_loss: bool, *, stop_signum: int, preempted: bool,
          device: torch.device, all_reduce: Callable[[torch.Tensor], None] | None = None) -> Agreed:
    """`all_reduce`: an in-place sum over the ranks (the survivors path's, over the live replicas); default the
    torch process group's."""
    flags = [float(has_loss), *(float(stop_signum == s) for s in STOP_SIGNALS), float(preempted)]
    t = torch.tensor([v if has_loss else 0.0 for v in losses] + flags, dtype=torch.float64, device=device)
    if all_reduce is not None:
        all_reduce(t)
    elif dist.is_initialized():
        dist.all_reduce(t)
    values = t.tolist()
    sums, count, seen, notices = values[:len(losses)], values[len(losses)], values[len(losses) + 1:-1], values[-1]
    signum = next((int(s) for s, n in zip(STOP_SIGNALS, seen) if n), 0)
    return Agreed([s / count for s in sums], signum, notices > 0)
