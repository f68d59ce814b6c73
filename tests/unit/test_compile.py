"""train.compile's policy and what it compiles, without compiling or importing Dynamo (the compiled runs:
tests/dist/test_compile_parity.py);
the step clock's deferred reads; the GPU comparison script's parsers."""

from __future__ import annotations

import pytest
import torch

from raydl.bench.gpu import result_name
from raydl.bench.gpu_vs_nanogpt import gpu_gaps, iteration_times, steady_tokens_per_s
from raydl.errors import ConfigError
from raydl.models.gpt import build_gpt
from raydl.overrides import load_config
from raydl.parallel import compile as compile_mod
from raydl.parallel.compile import choose_compile, repeated_blocks
from raydl.telemetry.step_clock import StepClock
from raydl.train.engines import apply_activation_checkpointing


def test_auto_compiles_on_cuda_only_and_false_never(monkeypatch):
    monkeypatch.setattr(compile_mod, "compiler_missing", lambda device_type: None)   # the real check: tests/dist
    assert not choose_compile("auto", "cpu").enabled
    assert not choose_compile("false", "cuda").enabled
    assert choose_compile("true", "cpu").enabled and choose_compile("auto", "cuda").fallback


def test_where_it_cannot_compile_true_refuses_and_auto_falls_back_with_a_reason(monkeypatch):
    monkeypatch.setattr(compile_mod, "compiler_missing", lambda device_type: "Triton is missing")
    with pytest.raises(ConfigError, match="train.compile.*Triton is missing.*train.compile=auto"):
        choose_compile("true", "cuda")
    choice = choose_compile("auto", "cuda")
    assert not choice.enabled and choice.unavailable and "Triton is missing" in choice.why


def test_a_bad_setting_is_refused_by_the_config():
    with pytest.raises(ConfigError, match="train.compile"):
        load_config(None, ["train.compile=yes"])


def test_only_the_repeated_blocks_compile_seen_through_activation_checkpointing():
    model = build_gpt("tiny", vocab_size=16, seq_len=8)
    assert repeated_blocks(model) == ["h0", "h1", "h2", "h3"]   # not the embedding nor the head
    apply_activation_checkpointing(model)
    assert repeated_blocks(model) == ["h0", "h1", "h2", "h3"]


def test_the_clock_reads_every_pending_loss_and_grad_norm_at_the_report():
    clock = StepClock()
    for step in (1, 2):
        clock.record(step=step, epoch=0, loss=torch.tensor(float(step)), lr=0.1, grad_norm=torch.tensor(0.5),
                     samples=4, world_size=1, data_wait_s=0.0, bad_shards=0, device=torch.device("cpu"), gpu={})
    assert isinstance(clock.pending[0].loss, torch.Tensor)   # still on the device between reports
    records = clock.drain()
    assert [(r.loss, r.grad_norm) for r in records] == [(1.0, 0.5), (2.0, 0.5)]
    assert all(type(r.loss) is float for r in records)


def test_result_files_are_named_by_card():
    assert result_name("NVIDIA H100 80GB HBM3", True) == "gpu-nvidia-h100-80gb-hbm3-compile.json"
    assert result_name("NVIDIA H200", False) == "gpu-nvidia-h200.json"


def test_nanogpt_iterations_and_their_steady_tokens_per_second():
    out = "step 0: train loss 10.9\n" + "".join(f"iter {i}: loss 3.5, time {2000 if i == 0 else 100}.00ms, "
                                                 f"mfu -100.00%\n" for i in range(10))
    times = iteration_times(out)
    assert times[0] == (0, 2.0) and len(times) == 10
    assert steady_tokens_per_s(times, 1000) == pytest.approx(10_000)   # 8 steady iterations of 0.1 s


def test_gpu_gaps_finds_idle_time_and_the_host_ops_under_it():
    events = [{"cat": "kernel", "ts": 0, "dur": 10}, {"cat": "kernel", "ts": 10, "dur": 10},
              {"cat": "kernel", "ts": 120, "dur": 30}, {"cat": "cpu_op", "name": "aten::item", "ts": 15, "dur": 100}]
    gaps = gpu_gaps(events)
    assert gaps["gaps"] == 1 and gaps["gaps_us"] == 100 and gaps["busy_share"] == pytest.approx(50 / 150)
    assert gaps["longest"] == [{"us": 100, "host_ops": ["aten::item"]}]
