"""`raydl bench`: the list of benchmarks and the error for a name that is not one."""

from __future__ import annotations

import pytest

from raydl.bench import BENCHMARKS
from raydl.cli import main


@pytest.mark.parametrize("argv", [["bench", "--list"], ["bench"]])
def test_bench_lists_every_benchmark_with_one_line(argv, capsys):
    assert main(argv) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [line.split()[0] for line in lines] == list(BENCHMARKS)
    assert {"ingest", "overhead", "pipeline", "recovery"} <= set(BENCHMARKS)
    assert all(len(line.split()) > 3 and "raydl bench" not in line for line in lines)


def test_unknown_benchmark_is_a_config_error_naming_the_valid_ones(capsys):
    assert main(["bench", "harness"]) == 2
    err = capsys.readouterr().err
    assert "'harness'" in err and all(name in err for name in BENCHMARKS)
