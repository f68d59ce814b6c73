"""The parts of `raydl bench gpu` that run without a GPU: its plain loop (on CPU here) and the step's one host
read of its device scalars."""

from __future__ import annotations

import pytest
import torch

from raydl.bench.gpu import main, plain_loop
from raydl.overrides import load_config
from raydl.train.step import host_values


def test_the_plain_loop_trains_the_configured_model_and_reports_tokens_per_second():
    cfg = load_config(None, ["model.name=gpt", "model.size=tiny", "train.max_steps=4", "train.global_batch_size=8",
                             "train.micro_batch_size=8"])
    result = plain_loop(cfg, torch.device("cpu"))
    assert result["tokens_per_s"] > 0


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is for machines without CUDA")
def test_without_cuda_the_bench_refuses_with_exit_2(capsys):
    assert main(["--data", "unused"]) == 2
    assert "no CUDA device" in capsys.readouterr().err


def test_host_values_reads_tensors_and_floats_in_their_order():
    loss, norm = torch.tensor(2.5), torch.tensor([3.0]).sum()
    assert host_values(loss, 1.5, norm) == [2.5, 1.5, 3.0]
    assert host_values(0.5, 2) == [0.5, 2.0]
