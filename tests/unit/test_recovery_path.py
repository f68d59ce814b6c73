"""Which layouts keep their survivors when a worker dies (raydl.parallel.recovery): pure, no processes."""

from __future__ import annotations

import pytest

from raydl.errors import ConfigError
from raydl.overrides import load_config
from raydl.parallel.recovery import choose


def path(*sets: str, torchft: bool = True):
    """The path scaling.survivors=auto (the default) takes, or that `sets` give."""
    return choose(load_config(None, ["scaling.survivors=auto", *sets]), torchft=torchft)


def test_data_parallel_runs_keep_their_survivors():
    assert path().survivors
    assert choose(load_config(None, []), torchft=True).survivors   # the default run, as `raydl train` starts it
    assert path("parallel.dp_wrapper=ddp", "scaling.min_workers=1", "scaling.max_workers=4",
                "train.global_batch_size=96").survivors   # 96 rows split over 1, 2, 3 or 4 workers


@pytest.mark.parametrize("sets, reason", [
    (("parallel.pp_degree=2",), "pipelines restart whole"),
    (("parallel.pp_degree=auto",), "pipelines restart whole"),
    (("parallel.dp_wrapper=fsdp",), "parallel.dp_wrapper=fsdp"),
    (("scaling.min_workers=1", "scaling.max_workers=1"), "a single worker"),
    (("scaling.min_workers=1", "scaling.max_workers=3"), "does not split over 3 worker(s)"),
    (("scaling.survivors=off",), "scaling.survivors=off"),
    (("scaling.max_failures=0",), "ends the run at the first failure"),
    (("telemetry.profile_steps=3",), "telemetry.profile_steps gathers every rank's profile"),
])
def test_other_layouts_restart_the_whole_group_and_say_why(sets, reason):
    chosen = path(*sets)
    assert not chosen.survivors and reason in chosen.why
    assert "whole group restarts" in chosen.describe() and reason in chosen.describe()


def test_without_torchft_auto_falls_back_and_on_is_a_config_error():
    assert "pip install torchft==0.2.0" in path(torchft=False).why
    with pytest.raises(ConfigError, match="scaling.survivors") as e:
        path("scaling.survivors=on", "parallel.pp_degree=2")
    assert "pipelines restart whole" in str(e.value)
