"""Where a profiled step's time goes: attribution rules on hand-made traces, and bad input to `raydl profile`.

Real traces from real processes (dp=2, pp=2, torchrun and Ray): tests/dist/test_profile.py."""

from __future__ import annotations

import pytest

from raydl.cli import main
from raydl.errors import ConfigError
from raydl.overrides import load_config
from raydl.telemetry.profile_breakdown import PARTS, attribute, format_table, rank_breakdown, self_times
from raydl.telemetry.profiler import StepProfiler

MAIN, GLOO = 100, 200   # the step's thread and a gloo communication thread


def span(name: str, start: float, end: float, *, tid: int = MAIN, cat: str = "cpu_op") -> dict:
    """One trace event, times in ms (the trace's µs = ms * 1000)."""
    return {"ph": "X", "name": name, "cat": cat, "tid": tid, "ts": start * 1e3, "dur": (end - start) * 1e3}


def ranged(phase: str, start: float, end: float) -> dict:
    return span(f"raydl.{phase}", start, end, cat="user_annotation")


def in_ms(parts: dict[str, float]) -> dict[str, float]:
    return {k: round(v * 1e3, 6) for k, v in parts.items() if v}


def data_parallel_step() -> list[dict]:
    """0-100 ms: data 0-10; forward 10-30; backward 30-75, its last 10 ms blocked on the all-reduce running
    on a gloo thread; 75-80 the loss read outside both ranges; optimizer 80-95; loop bookkeeping to 100."""
    return [ranged("step", 0, 100), ranged("data_wait", 0, 10), ranged("forward_backward", 10, 80),
            ranged("forward", 10, 30), span("aten::addmm", 12, 28),
            ranged("backward", 30, 75), span("autograd::engine::evaluate_function: AddmmBackward0", 31, 60),
            span("c10d::allreduce_", 60, 61), span("gloo:all_reduce", 58, 71, tid=GLOO, cat="user_annotation"),
            span("aten::item", 75, 77), ranged("optimizer", 80, 95), span("aten::lerp_", 81, 94)]


def test_data_parallel_parts_come_from_raydls_ranges_and_the_exposed_all_reduce():
    parts = attribute(data_parallel_step(), 0, 100e3, main_tid=MAIN, pipelined=False)
    # backward keeps the all-reduce it overlapped (58-60, computing); 60-61 is the launch, 61-71 the exposed wait
    assert in_ms(parts) == {"data_wait": 10, "forward": 20 + 2, "backward": 30 + 4, "collective": 11,
                            "optimizer": 15, "other": 3 + 5}
    assert sum(parts.values()) == pytest.approx(0.1)


def pipeline_step() -> list[dict]:
    """forward_backward 0-100 ms run by torch's schedule: forward ops, a backward, a send, 35 ms waiting for
    the peer (gloo's own recv span covers it, and is not a cost), the recv call, a last forward op."""
    return [ranged("step", 0, 100), ranged("forward_backward", 0, 100), span("aten::linear", 0, 20),
            span("autograd::engine::evaluate_function: MmBackward0", 20, 50), span("c10d::send", 50, 55),
            span("gloo:send", 51, 70, cat="user_annotation"), span("gloo:recv", 55, 90, cat="user_annotation"),
            span("c10d::recv_", 90, 95), span("aten::gelu", 95, 100)]


def test_pipeline_wait_for_a_peer_is_bubble_and_the_calls_are_send_recv():
    parts = attribute(pipeline_step(), 0, 100e3, main_tid=MAIN, pipelined=True)
    assert in_ms(parts) == {"forward": 25, "backward": 30, "send_recv": 10, "bubble": 35}


def test_without_a_pipeline_uncovered_time_is_other_not_bubble():
    parts = attribute(pipeline_step(), 0, 100e3, main_tid=MAIN, pipelined=False)
    assert parts["bubble"] == 0 and in_ms(parts)["other"] == 35


def test_a_window_counts_only_what_lies_inside_it():
    parts = attribute(data_parallel_step(), 20e3, 40e3, main_tid=MAIN, pipelined=False)
    assert in_ms(parts) == {"forward": 10, "backward": 10}


def test_self_time_leaves_out_nested_ops():
    ops = [span("aten::linear", 0, 10), span("aten::addmm", 1, 9), span("aten::copy_", 2, 3), span("aten::mm", 20, 25)]
    assert {k: v / 1e3 for k, v in self_times(ops).items()} == {"aten::linear": 2, "aten::addmm": 7, "aten::copy_": 1,
                                                                  "aten::mm": 5}


def test_rank_breakdown_averages_steps_and_the_table_shows_every_part():
    second = [dict(e, ts=e["ts"] + 200e3) for e in data_parallel_step()]
    rank = rank_breakdown(data_parallel_step() + second, [0.101, 0.099], pipelined=False)
    assert rank["step_s"] == pytest.approx(0.1) and rank["parts"]["optimizer"] == pytest.approx(0.015)
    assert rank["top_ops"][0] == {"name": "autograd::engine::evaluate_function: AddmmBackward0",
                                  "self_s": pytest.approx(0.029), "calls": 1.0}
    assert rank["top_kernels"] == []
    table = format_table({"steps": [4, 5], "dir": "runs/x/profile",
                          "ranks": [{"rank": 0, "dp_rank": 0, "pp_rank": 0, **rank}]})
    row = next(line for line in table.splitlines() if line.split()[:3] == ["0", "0", "0"])
    assert [float(x) for x in row.split()[3:]] == pytest.approx([100, 22, 34, 11, 0, 0, 15, 10, 8])
    assert len(PARTS) == 8 and "top ops by self time" in table


def test_a_cuda_trace_s_step_ranges_drawn_on_the_gpu_timeline_are_not_counted_as_steps():
    # torch 2.11 on an H100 exported each raydl.step twice: on the CPU thread and as a gpu_user_annotation
    gpu_copies = [dict(ranged("step", 2, 98), cat="gpu_user_annotation", tid=7), span("sm90_gemm", 12, 28, tid=7,
                                                                                      cat="kernel")]
    rank = rank_breakdown(data_parallel_step() + gpu_copies, [0.1], pipelined=False)
    assert rank["step_s"] == pytest.approx(0.1) and rank["parts"]["optimizer"] == pytest.approx(0.015)
    assert rank["top_kernels"] == [{"name": "sm90_gemm", "device_s": pytest.approx(0.016)}]


def test_a_trace_missing_step_ranges_is_refused():
    with pytest.raises(ValueError, match="2 raydl.step ranges for 3 profiled steps"):
        rank_breakdown(data_parallel_step() + [dict(e, ts=e["ts"] + 200e3) for e in data_parallel_step()],
                       [0.1, 0.1, 0.1], pipelined=False)


def test_a_group_too_short_to_profile_says_so(caplog, tmp_path):
    class Session:
        rank = 0

    profiler = StepProfiler(3, first_step=1, last_step=3, run_dir=str(tmp_path), session=Session(), layout=None)
    assert not profiler.steps and "nothing profiled" in caplog.text
    for step in (1, 2, 3):
        profiler.begin(step)
        profiler.end(step)
    assert not (tmp_path / "profile").exists()


def test_profile_steps_is_checked_and_the_cli_refuses_zero_steps(capsys):
    with pytest.raises(ConfigError, match="telemetry.profile_steps"):
        load_config(None, ["telemetry.profile_steps=-1"])
    assert load_config(None, ["telemetry.profile_steps=2"]).telemetry.profile_steps == 2
    assert main(["profile", "--steps", "0"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("raydl: error: ") and "'--steps' is 0" in err and "Traceback" not in err
