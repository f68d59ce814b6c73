"""The loss as a step sees it: the SUM of per-token losses and the COUNT of target tokens (a target of -100 is no
target), so that a step can divide the sum over its whole global batch by the global count, whatever the split of
that batch over ranks, micro-batches and pipeline stages (raydl.train.step, raydl.train.engines).

    total, count = loss_terms(spec.loss, outputs, targets)     # a user's mean loss: mean x count

A last block that is a `VocabHead` (raydl's gpt and Hugging Face models) can hand back its hidden states before its
vocabulary projection: the built-in token cross-entropy then projects them chunk by chunk
(`chunked_cross_entropy`), so no rank ever holds a whole micro-batch's fp32 logits, only one chunk's.
"""

from __future__ import annotations

import contextlib
import functools
from typing import Callable, Iterator

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["IGNORE_INDEX", "CHUNK_TOKENS", "LossTerms", "target_count", "loss_terms", "token_mean",
           "token_cross_entropy", "model_loss", "chunked_cross_entropy", "VocabHead", "vocab_head", "head_output",
           "logits_out", "chunked", "chunk_bytes"]

IGNORE_INDEX = -100
# Tokens per chunk of logits: at GPT-2's vocabulary (50304) one chunk's fp32 logits are 403 MiB, a twentieth of
# a 16 x 1024-token micro-batch's, and each chunk's matmul is still large enough to keep a GPU busy.
CHUNK_TOKENS = 2048

LossTerms = tuple[torch.Tensor, torch.Tensor]   # (sum of per-target losses, count of targets), device scalars


def target_count(targets: torch.Tensor) -> torch.Tensor:
    """How many targets a loss averages over: integer targets (token labels, classes) not equal to -100; every
    element of floating-point targets (a regression's). A device scalar: counting never waits for the device."""
    if targets.is_floating_point():
        return torch.full((), targets.numel(), dtype=torch.int64, device=targets.device)
    return (targets != IGNORE_INDEX).sum()


def loss_terms(loss_fn: Callable, outputs: torch.Tensor, targets: torch.Tensor) -> LossTerms:
    """(sum, count) of `loss_fn` (a ModelSpec.loss): the pair it returns, or the mean it returns times the count
    of `targets` (a user's loss that averages over its targets keeps working)."""
    value = loss_fn(outputs, targets)
    if isinstance(value, tuple):
        return value
    count = target_count(targets)
    return torch.where(count > 0, value * count, torch.zeros_like(value)), count


def token_mean(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean token cross-entropy in fp32 over labelled positions (label -100 = ignored): the built-in models'
    ModelSpec.loss, which `model_loss` computes as `token_cross_entropy`, or chunk by chunk."""
    return F.cross_entropy(logits.float().flatten(0, -2), labels.flatten(), ignore_index=IGNORE_INDEX)


def token_cross_entropy(logits: torch.Tensor, labels: torch.Tensor) -> LossTerms:
    """Token cross-entropy in fp32 summed over labelled positions (label -100 = ignored), and their count."""
    total = F.cross_entropy(logits.float().flatten(0, -2), labels.flatten(), ignore_index=IGNORE_INDEX,
                            reduction="sum")
    return total, target_count(labels)


def model_loss(spec_loss: Callable, model: nn.Module) -> Callable[[torch.Tensor, torch.Tensor], LossTerms]:
    """The (sum, count) loss of `model`'s outputs (a pipeline stage's: the last one's) for a ModelSpec.loss. The
    built-in token cross-entropy on a model ending in a VocabHead goes chunk by chunk: the head then returns its
    hidden states (set here, once), and the loss reads its projection's weight at each call, where FSDP2 has put
    the gathered one (the last block is not resharded after forward: raydl.parallel.data_parallel)."""
    if spec_loss is not token_mean:
        return functools.partial(loss_terms, spec_loss)
    if not chunked(spec_loss, model):
        return token_cross_entropy
    head = vocab_head(model)
    head.hidden_out = True
    return lambda hidden, labels: chunked_cross_entropy(hidden, head.projection(), labels, chunk_tokens=CHUNK_TOKENS)


class VocabHead(nn.Module):
    """A model's last block ending in a projection to the vocabulary. With `hidden_out` set its forward returns
    the hidden states the projection would take, and the loss applies `projection()` itself, chunk by chunk."""

    hidden_out = False

    def projection(self) -> nn.Module:
        """The projection: a module with `weight` (vocabulary x hidden) and, maybe, `bias`."""
        raise NotImplementedError


def vocab_head(model: nn.Module) -> VocabHead | None:
    """The model's (or a pipeline stage's) VocabHead, inside any wrapper (DDP, FSDP2, activation checkpointing)."""
    return next((m for m in model.modules() if isinstance(m, VocabHead)), None)


@contextlib.contextmanager
def head_output(model: nn.Module, *, hidden: bool) -> Iterator[None]:
    """Inside, the head returns hidden states or logits (evaluation: accuracy needs logits), whatever it returns
    outside."""
    head = vocab_head(model)
    saved = head.hidden_out if head is not None else None
    if head is not None:
        head.hidden_out = hidden
    try:
        yield
    finally:
        if head is not None:
            head.hidden_out = saved


def logits_out(model: nn.Module) -> contextlib.AbstractContextManager:
    return head_output(model, hidden=False)


def chunked(spec_loss: Callable, model: nn.Module) -> bool:
    """Whether `model_loss` goes chunk by chunk for this loss and model."""
    return spec_loss is token_mean and vocab_head(model) is not None


def chunk_bytes(vocab_size: int, chunk_tokens: int = CHUNK_TOKENS) -> int:
    """What one chunk of `chunked_cross_entropy` holds at its peak: the chunk's fp32 logits, their exponentials
    (the gradient, in backward) and a half-precision copy of that gradient for its matmuls."""
    return chunk_tokens * vocab_size * (4 + 4 + 2)


def chunked_cross_entropy(hidden: torch.Tensor, head: nn.Module, labels: torch.Tensor, *,
                          chunk_tokens: int = CHUNK_TOKENS) -> LossTerms:
    """`token_cross_entropy(head(hidden), labels)` without the logits of more than `chunk_tokens` tokens at a time:
    forward keeps each token's log-sum-exp only; backward projects each chunk again (one more matmul of the
    head's three) and turns it into its gradient at once. Under autocast the matmuls run in its dtype, the
    softmax in fp32, as autocast would for the unchunked loss."""
    weight, bias = head.weight, getattr(head, "bias", None)   # a tied projection has no bias
    device_type = hidden.device.type
    if torch.is_autocast_enabled(device_type):
        dtype = torch.get_autocast_dtype(device_type)
        hidden, weight = hidden.to(dtype), weight.to(dtype)
        bias = bias.to(dtype) if bias is not None else None
    flat_labels = labels.flatten()
    total = _ChunkedCrossEntropy.apply(hidden.flatten(0, -2), weight, bias, flat_labels, chunk_tokens)
    return total, target_count(flat_labels)


def _logits(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return F.linear(hidden, weight, bias).float()


class _ChunkedCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, bias, labels, chunk_tokens: int):
        with torch.autocast(hidden.device.type, enabled=False):
            sums, lses = [], []
            for start in range(0, hidden.shape[0], chunk_tokens):
                logits = _logits(hidden[start:start + chunk_tokens], weight, bias)
                chunk_labels = labels[start:start + chunk_tokens]
                lse = torch.logsumexp(logits, dim=-1)
                picked = logits.gather(1, chunk_labels.clamp(min=0).unsqueeze(1)).squeeze(1)
                sums.append(((lse - picked) * (chunk_labels != IGNORE_INDEX)).sum())
                lses.append(lse)
        ctx.save_for_backward(hidden, weight, bias, labels, torch.cat(lses))
        ctx.chunk_tokens = chunk_tokens
        return torch.stack(sums).sum()

    @staticmethod
    def backward(ctx, grad_total):
        hidden, weight, bias, labels, lse = ctx.saved_tensors
        chunk = ctx.chunk_tokens
        want_hidden, want_weight, want_bias = ctx.needs_input_grad[:3]
        grad_hidden = torch.empty_like(hidden) if want_hidden else None
        grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if want_weight else None
        grad_bias = torch.zeros(bias.shape, dtype=torch.float32, device=bias.device) if want_bias else None
        with torch.autocast(hidden.device.type, enabled=False):
            for start in range(0, hidden.shape[0], chunk):
                h, chunk_labels = hidden[start:start + chunk], labels[start:start + chunk]
                # d(lse - picked)/d(logits) = softmax - one_hot(label), zero on ignored rows
                grad = _logits(h, weight, bias).sub_(lse[start:start + chunk, None]).exp_()
                grad.scatter_add_(1, chunk_labels.clamp(min=0).unsqueeze(1),
                                  torch.full_like(grad[:, :1], -1.0))
                grad.mul_(((chunk_labels != IGNORE_INDEX) * grad_total).unsqueeze(1))
                grad = grad.to(hidden.dtype)
                if want_hidden:
                    grad_hidden[start:start + chunk] = grad @ weight
                if want_weight:
                    grad_weight += (grad.t() @ h).float()
                if want_bias:
                    grad_bias += grad.float().sum(0)
        return (grad_hidden, grad_weight.to(weight.dtype) if want_weight else None,
                grad_bias.to(bias.dtype) if want_bias else None, None, None)
