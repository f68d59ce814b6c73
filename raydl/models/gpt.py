"""Decoder-only transformer (GPT-2 style, pre-norm) as blocks: embed, h0..h{n-1}, head.

The `gpt2` preset is GPT-2 124M as nanoGPT has it (bias=True): its head is tied to the token embedding and its
vocabulary padded to a multiple of 64 (50257 -> 50304). In a pipeline the tied pair sits on the first and the last
stage: each holds a copy, their gradients are summed every step (raydl.train.engines, as Megatron does), and a
checkpoint stores the weight once, under the embedding's name (raydl.train.checkpoint).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from raydl.errors import ConfigError
from raydl.models.blocks import BlockModel
from raydl.models.loss import VocabHead, token_mean
from raydl.models.packing import document_causal_mask, document_positions, packed_kwargs
from raydl.models.presets import GPT_SIZES, GptOptions
from raydl.models.spec import ModelSpec


class Embedding(nn.Module):
    def __init__(self, vocab_size: int, seq_len: int, width: int, dropout: float):
        super().__init__()
        self.tok = nn.Embedding(vocab_size, width)
        self.pos = nn.Embedding(seq_len, width)
        self.drop = nn.Dropout(dropout)

    def forward(self, idx: torch.Tensor, documents: torch.Tensor | None = None) -> torch.Tensor:
        if documents is None:
            positions = torch.arange(idx.shape[1], device=idx.device)
        else:   # packed rows: positions restart at every record
            positions = document_positions(documents)
        return self.drop(self.tok(idx) + self.pos(positions))  # (B, T, C)


class Attention(nn.Module):
    def __init__(self, width: int, heads: int, dropout: float):
        super().__init__()
        self.heads, self.dropout = heads, dropout
        self.qkv = nn.Linear(width, 3 * width)
        self.proj = nn.Linear(width, width)

    def forward(self, x: torch.Tensor, documents: torch.Tensor | None = None) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = self.qkv(x).split(C, dim=2)
        q, k, v = (t.view(B, T, self.heads, C // self.heads).transpose(1, 2) for t in (q, k, v))  # (B, nh, T, hs)
        # packed rows: each record attends only to itself (block-diagonal causal)
        mask = None if documents is None else document_causal_mask(documents)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None,
                                           dropout_p=self.dropout if self.training else 0.0)
        return self.proj(y.transpose(1, 2).reshape(B, T, C))


class TransformerBlock(nn.Module):
    def __init__(self, width: int, heads: int, dropout: float):
        super().__init__()
        self.ln1 = nn.LayerNorm(width)
        self.attn = Attention(width, heads, dropout)
        self.ln2 = nn.LayerNorm(width)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width), nn.Dropout(dropout))

    def forward(self, x: torch.Tensor, documents: torch.Tensor | None = None) -> torch.Tensor:
        x = x + self.attn(self.ln1(x), documents)
        return x + self.mlp(self.ln2(x))


class TiedProjection(nn.Embedding):
    """The head's projection as the token embedding's weight (an Embedding, so that a copy of it, on another pipeline
    stage, is initialized exactly as the embedding: same seed, same draws)."""

    def __init__(self, embedding: nn.Embedding):
        super().__init__(embedding.num_embeddings, embedding.embedding_dim)
        self._tied_to = [embedding]   # in a list: not a submodule
        self.weight = embedding.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight)

    def untie(self) -> None:
        """A weight of its own, equal to the embedding's (a pipeline: the two sit on different stages)."""
        self.weight = nn.Parameter(self.weight.detach().clone())

    def retie(self, model: nn.Module) -> None:
        """The embedding's weight again, where `model` holds the embedding too (a materialized whole model)."""
        if any(m is self._tied_to[0] for m in model.modules()):
            self.weight = self._tied_to[0].weight


class Head(VocabHead):
    def __init__(self, width: int, vocab_size: int, tied_to: nn.Embedding | None = None):
        super().__init__()
        self.ln = nn.LayerNorm(width)
        self.out = TiedProjection(tied_to) if tied_to is not None else nn.Linear(width, vocab_size, bias=False)

    def projection(self) -> nn.Module:
        return self.out

    def forward(self, x: torch.Tensor, documents: torch.Tensor | None = None) -> torch.Tensor:
        """`documents`: taken as every block takes it (BlockModel); a token's head reads that token alone."""
        x = self.ln(x)
        return x if self.hidden_out else self.out(x)  # (B, T, width) or (B, T, vocab)


def build_gpt(size: str, *, vocab_size: int, seq_len: int, dropout: float = 0.0) -> BlockModel:
    options = GptOptions(size=size)
    return gpt_blocks(*GPT_SIZES[size], vocab_size=options.vocab_rows(vocab_size), seq_len=seq_len, dropout=dropout,
                      tied=options.tied)


def gpt_blocks(layers: int, width: int, heads: int, *, vocab_size: int, seq_len: int, dropout: float,
               tied: bool = False) -> BlockModel:
    embed = Embedding(vocab_size, seq_len, width, dropout)
    blocks: dict[str, nn.Module] = {"embed": embed}
    for i in range(layers):
        blocks[f"h{i}"] = TransformerBlock(width, heads, dropout)
    blocks["head"] = head = Head(width, vocab_size, tied_to=embed.tok if tied else None)
    model = BlockModel(blocks)
    if tied:
        model.init_like = {head.out: embed.tok}   # a pipeline's copy drawn as the embedding (model_build)
        model.tied = {"blocks.head.out.weight": "blocks.embed.tok.weight"}
    model.apply(_init_weights)
    return model


def _init_weights(module: nn.Module) -> None:
    # GPT-2's init: N(0, 0.02) weights, zero biases.
    if isinstance(module, (nn.Linear, nn.Embedding)):
        nn.init.normal_(module.weight, mean=0.0, std=0.02)
    if isinstance(module, nn.Linear) and module.bias is not None:
        nn.init.zeros_(module.bias)


gpt_loss = token_mean   # mean token cross-entropy over labelled positions (label -100 = ignored)


def gpt_correct(logits: torch.Tensor, labels: torch.Tensor) -> tuple[int, int]:
    mask = labels != -100
    return int(((logits.argmax(-1) == labels) & mask).sum()), int(mask.sum())


def gpt_flops_per_token(layers: int, width: int, *, vocab_size: int, seq_len: int) -> float:
    """Training FLOPs per token, PaLM appendix B / nanoGPT: 6N + 12·L·H·Q·T (N = non-embedding params)."""
    n = layers * 12 * width * width + width * vocab_size
    return 6 * n + 12 * layers * width * seq_len


def _at_least_the_dataset(option: str, given: int, needed: int, what: str) -> int:
    if given and given < needed:
        raise ConfigError(f"model.options.{option}", f"is {given}, below the dataset's {what} ({needed})",
                          f"use 0 (the dataset's) or at least {needed}")
    return given or needed


def build(options: GptOptions, meta: dict[str, Any]) -> BlockModel:
    _at_least_the_dataset("vocab", options.vocab, meta["vocab_size"], "vocab_size")
    context = _at_least_the_dataset("seq_len", options.seq_len, meta["seq_len"], "seq_len")
    return gpt_blocks(*options.dims(), vocab_size=options.vocab_rows(meta["vocab_size"]), seq_len=context,
                      dropout=options.dropout, tied=options.tied)


def flops_per_sample(options: GptOptions, meta: dict[str, Any]) -> float:
    layers, width, _ = options.dims()
    vocab = options.vocab_rows(meta["vocab_size"])
    return meta["seq_len"] * gpt_flops_per_token(layers, width, vocab_size=vocab, seq_len=meta["seq_len"])


def tokens(batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """(input ids, labels). Records of varying length (raydl data prepare --format) come right-padded per batch with
    a mask: the padding gets label -100, and under causal attention no real token attends to it."""
    labels = batch["labels"].long()
    if "labels_mask" in batch:
        labels = labels.masked_fill(~batch["labels_mask"], -100)
    return batch["input_ids"].long(), labels


def random_tokens(meta: dict[str, Any], micro_batch: int) -> torch.Tensor:
    return torch.randint(meta["vocab_size"], (micro_batch, meta["seq_len"]))


spec = ModelSpec(name="gpt", build=build, inputs_targets=tokens, loss=gpt_loss, example_inputs=random_tokens,
                 correct=gpt_correct, units_per_sample=lambda meta: meta["seq_len"], flops_per_sample=flops_per_sample,
                 options=GptOptions, task="tokens", columns=("input_ids", "labels"), init_weights=_init_weights,
                 init_by_rows=True, forward_kwargs=packed_kwargs)
