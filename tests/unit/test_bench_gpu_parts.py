"""The parts of `raydl bench gpu` that run without a GPU: its plain loop (on CPU here) and the step's one host
read of its device scalars."""

from __future__ import annotations

import json

import pytest
import torch

from raydl.bench.gpu import main, plain_loop, worker_result
from raydl.overrides import load_config
from raydl.telemetry.step_clock import host_values


def test_the_plain_loop_trains_the_configured_model_and_reports_tokens_per_second():
    cfg = load_config(None, ["model.name=gpt", "model.size=tiny", "train.max_steps=4", "train.global_batch_size=8",
                             "train.micro_batch_size=8"])
    result = plain_loop(cfg, torch.device("cpu"))
    assert result["tokens_per_s"] > 0 and result["step_rate"] > 0
    assert result["tokens_per_s"] == pytest.approx(result["samples_per_s"] * 8)   # tiny gpt's built-in rows: 8 tokens


def test_a_worker_result_has_the_nvml_readings_of_its_records_and_its_summary_rates(tmp_path):
    # metrics.jsonl as MetricsWriter writes it on a GPU: the NVML readings are top-level keys of each record
    # (the bench once looked for a "gpu" key and reported none, seen on an H100 on 2026-11-25).
    (tmp_path / "summary.json").write_text(json.dumps({"tokens_per_s": 2048.0, "samples_per_s": 2.0, "step_rate": 2.5, "mfu": 0.25,
                                                       "model_tflops_per_s": 247.0, "peak_memory_mb": 100.0}))
    records = [{"step": i, "samples": 4, "time": 100.0 + 2 * i, "gpu_util_pct": 90 + i % 3, "gpu_power_w": 500.0,
                "gpu_mem_used_mb": 1000.0, "gpu_temp_c": 50} for i in range(1, 11)]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    result = worker_result(tmp_path)
    assert result["nvml_gpu_util_pct"] == 91 and result["nvml_gpu_power_w"] == 500.0
    assert (result["tokens_per_s"], result["step_rate"]) == (2048.0, 2.5)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is for machines without CUDA")
def test_without_cuda_the_bench_refuses_with_exit_2(capsys):
    assert main(["--data", "unused"]) == 2
    assert "no CUDA device" in capsys.readouterr().err


def test_host_values_reads_tensors_and_floats_in_their_order():
    loss, norm = torch.tensor(2.5), torch.tensor([3.0]).sum()
    assert host_values(loss, 1.5, norm) == [2.5, 1.5, 3.0]
    assert host_values(0.5, 2) == [0.5, 2.0]
