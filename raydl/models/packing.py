"""Packed rows (raydl data prepare --pack) inside the models: each record's positions restart at 0, and its tokens
attend only to earlier tokens of the same record (a block-diagonal causal mask, given to PyTorch's SDPA).

    kwargs = packed_kwargs(batch)                  # {"documents": (rows, seq) ids, padding -1} or {} unpacked
    model(input_ids, **kwargs)                     # BlockModel hands `documents` to every block
    positions = document_positions(documents)      # 0.. per record
    mask = document_causal_mask(documents)         # (rows, 1, seq, seq) bool, True = may attend

The document ids travel with the micro-batch as a keyword of the model's forward: torch's pipeline schedules hand
`step()`'s keywords, split like the inputs, to every stage (raydl.train.engines.PipelineEngine), so each stage
builds the mask it needs from them. Padding after a row's last record is a document of its own (-1), so every
query attends to at least itself (an all-False mask row would make SDPA return NaN).
"""

from __future__ import annotations

import torch

from raydl.data.columns import DOCUMENTS, MASK_SUFFIX

__all__ = ["packed_kwargs", "document_positions", "document_causal_mask"]

PADDING_DOCUMENT = -1


def packed_kwargs(batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The keywords of a model's forward for this batch: `documents` when its rows are packed, else none."""
    if DOCUMENTS not in batch:
        return {}
    documents = batch[DOCUMENTS].long()
    real = batch.get(DOCUMENTS + MASK_SUFFIX)
    return {"documents": documents if real is None else documents.masked_fill(~real, PADDING_DOCUMENT)}


def document_positions(documents: torch.Tensor) -> torch.Tensor:
    """(rows, seq) position of each token within its record: 0 where a record starts."""
    index = torch.arange(documents.shape[1], device=documents.device).expand_as(documents)
    starts = torch.ones_like(documents, dtype=torch.bool)
    starts[:, 1:] = documents[:, 1:] != documents[:, :-1]
    return index - torch.where(starts, index, 0).cummax(dim=1).values


def document_causal_mask(documents: torch.Tensor) -> torch.Tensor:
    """(rows, 1, seq, seq) bool: query i may attend key j when j <= i and both are of the same record."""
    seq = documents.shape[1]
    causal = torch.ones(seq, seq, dtype=torch.bool, device=documents.device).tril()
    return (documents[:, None, :, None] == documents[:, None, None, :]) & causal
