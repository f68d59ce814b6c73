"""The FLOPs behind raydl's MFU (6N per token plus attention, PaLM appendix B) against a hand count: torch's
FlopCounterMode over one forward and backward, attention in the math kernel so that its matmuls are counted
(the fused CPU kernel is not), both counting the full T x T attention as the formula does."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from raydl.models.gpt import gpt_blocks, gpt_flops_per_token
from raydl.models.hf.model import build, flops_per_sample
from raydl.models.hf.options import HfOptions
from raydl.telemetry.step_clock import PEAK_FLOPS


def _counted_flops(model: torch.nn.Module, tokens: torch.Tensor) -> int:
    with FlopCounterMode(display=False) as counter, sdpa_kernel(SDPBackend.MATH):
        model(tokens).float().sum().backward()
    return counter.get_total_flops()


def test_gpt_flops_per_token_is_the_hand_count_of_its_matmuls():
    layers, width, heads, vocab, seq = 2, 64, 4, 96, 32
    model = gpt_blocks(layers, width, heads, vocab_size=vocab, seq_len=seq, dropout=0.0)
    tokens = torch.randint(0, vocab, (3, seq))
    assert _counted_flops(model, tokens) == gpt_flops_per_token(layers, width, vocab_size=vocab, seq_len=seq) * 3 * seq


def test_hf_llama_flops_per_sample_is_within_a_percent_of_the_hand_count():
    """Llama's grouped-query attention and SwiGLU MLP: N counts every parameter past the input embeddings (the
    norms' few weights are not matmuls: the formula's only surplus)."""
    meta = {"vocab_size": 64, "seq_len": 16, "eos": 63}
    options = HfOptions(family="llama", num_hidden_layers=2, hidden_size=64, num_key_value_heads=2)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = build(options, meta)
    counted = _counted_flops(model, torch.randint(0, 64, (2, 16)))
    assert counted == pytest.approx(2 * flops_per_sample(options, meta), rel=0.01)


def test_the_hopper_peak_is_the_datasheets_dense_bf16():
    assert PEAK_FLOPS["H100"] == PEAK_FLOPS["H200"] == 989e12
