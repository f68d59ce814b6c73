"""The one all-reduce at a report (raydl.train.agree) over 2 gloo ranks: losses averaged over the ranks that
computed one, and a stop signal or preemption notice seen by one rank reaches both."""

from __future__ import annotations

import json
import signal
from pathlib import Path

import pytest
import torch

from raydl.train.agree import agree
from tests.helpers import run_gloo


def agree_on_rank(rank: int, world_size: int, out: str) -> None:
    cases = {
        "stop on rank 1": agree([1.0 + rank, 3.0], True, stop_signum=signal.SIGTERM if rank else 0, preempted=False,
                                device=torch.device("cpu")),
        "notice on rank 0, loss on rank 1 only": agree([5.0 * rank], rank == 1, stop_signum=0, preempted=rank == 0,
                                                       device=torch.device("cpu")),
        "SIGINT wins": agree([0.0], True, stop_signum=signal.SIGINT if rank else signal.SIGTERM, preempted=False,
                             device=torch.device("cpu")),
    }
    Path(out, f"{rank}.json").write_text(json.dumps({k: [v.losses, v.stop_signum, v.preempted]
                                                     for k, v in cases.items()}))


@pytest.mark.slow
def test_every_rank_gets_the_same_losses_and_signals(tmp_path):
    run_gloo(agree_on_rank, 2, str(tmp_path))
    ranks = [json.loads((tmp_path / f"{r}.json").read_text()) for r in (0, 1)]
    assert ranks[0] == ranks[1]
    assert ranks[0]["stop on rank 1"] == [[1.5, 3.0], signal.SIGTERM, False]
    assert ranks[0]["notice on rank 0, loss on rank 1 only"] == [[5.0], 0, True]
    assert ranks[0]["SIGINT wins"][1] == signal.SIGINT


def test_one_process_without_a_group_agrees_with_itself():
    agreed = agree([2.0, 4.0], True, stop_signum=signal.SIGINT, preempted=True, device=torch.device("cpu"))
    assert (agreed.losses, agreed.stop_signum, agreed.preempted) == ([2.0, 4.0], signal.SIGINT, True)
