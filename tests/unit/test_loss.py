"""The loss interface (raydl.models.loss): (sum, count) from any ModelSpec.loss, and the chunked cross-entropy equal
to the whole-logits one, in value and gradients, with -100 labels anywhere (a whole chunk of them included)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from raydl.models.gpt import TiedProjection
from raydl.models.loss import chunked_cross_entropy, loss_terms, target_count, token_cross_entropy, token_mean


def _labels(rows: int, seq: int, vocab: int) -> torch.Tensor:
    labels = torch.randint(vocab, (rows, seq), generator=torch.Generator().manual_seed(1))
    labels[0, :4] = -100      # a prompt
    labels[1, 3:] = -100      # padding
    labels[2] = -100          # a row without targets: whole chunks of ignored tokens
    return labels


@pytest.mark.parametrize("projection", ["linear with bias", "tied"])
def test_chunked_equals_whole_logits_in_value_and_gradients(projection):
    torch.manual_seed(0)
    rows, seq, width, vocab = 4, 9, 16, 50
    if projection == "tied":
        head = TiedProjection(torch.nn.Embedding(vocab, width))
    else:
        head = torch.nn.Linear(width, vocab)
    hidden = torch.randn(rows, seq, width, requires_grad=True)
    labels = _labels(rows, seq, vocab)
    params = [hidden, *head.parameters()]

    total, count = chunked_cross_entropy(hidden, head, labels, chunk_tokens=5)   # 36 tokens: 8 chunks, cut mid-row
    chunked_grads = torch.autograd.grad(total, params)
    expected, expected_count = token_cross_entropy(head(hidden), labels)
    whole_grads = torch.autograd.grad(expected, params)

    assert int(count) == int(expected_count) == int((labels != -100).sum())
    torch.testing.assert_close(total, expected, rtol=1e-6, atol=0)
    for got, want in zip(chunked_grads, whole_grads):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    assert chunked_grads[0][2].abs().sum() == 0   # the row without targets gets no gradient


def test_chunked_under_bf16_autocast_matches_autocast_logits():
    torch.manual_seed(0)
    head, hidden = torch.nn.Linear(16, 50), torch.randn(3, 9, 16)
    labels = _labels(3, 9, 50)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        total, _ = chunked_cross_entropy(hidden, head, labels, chunk_tokens=4)
        expected, _ = token_cross_entropy(head(hidden), labels)
    assert total.dtype == torch.float32
    torch.testing.assert_close(total, expected, rtol=1e-3, atol=0)


def test_a_mean_loss_is_taken_as_mean_times_its_count_of_targets():
    logits, labels = torch.randn(3, 5, 7), _labels(3, 5, 7)
    total, count = loss_terms(token_mean, logits, labels)
    expected, _ = token_cross_entropy(logits, labels)
    assert int(count) == int((labels != -100).sum())
    torch.testing.assert_close(total, expected)
    predictions, targets = torch.randn(4, 3), torch.randn(4, 3)   # a regression: every element a target
    total, count = loss_terms(F.mse_loss, predictions, targets)
    assert int(count) == 12 and torch.allclose(total, ((predictions - targets) ** 2).sum())
    pair = (torch.tensor(3.0), torch.tensor(2))
    assert loss_terms(lambda o, t: pair, predictions, targets) is pair   # a loss that returns the pair itself
    assert int(target_count(torch.full((3,), -100))) == 0
