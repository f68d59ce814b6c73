"""Built-in learnable datasets, generated deterministically from a seed on first use (no download).

- tokens: character-level addition `37+05=240` with the sum written least-significant
  digit first (the way one adds by hand), which a ~1M-parameter GPT learns in a few hundred
  steps. Only the answer digits carry labels, so the loss is the model's uncertainty
  about the sum, and token accuracy is the share of answer digits right.
- images: 32x32 RGB pictures of procedurally drawn shapes (disc, square, cross, stripes)
  at random positions, sizes and colours, on noise; label = shape.
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa

VOCAB = "0123456789+="
DIGITS = 2
TOKENS_META = {"task": "tokens", "vocab_size": 16, "seq_len": 3 * DIGITS + 3}   # 12 symbols, rounded up to 16
SHAPES = ("disc", "square", "cross", "stripes")
IMAGES_META = {"task": "images", "num_classes": len(SHAPES), "image_shape": [3, 32, 32]}


def arithmetic_table(ids: np.ndarray, seed: int) -> pa.Table:
    rng = np.random.default_rng([seed, int(ids[0]) if len(ids) else 0])
    a, b = rng.integers(0, 10 ** DIGITS, size=(2, len(ids)))
    text = [f"{x:0{DIGITS}d}+{y:0{DIGITS}d}={str(x + y).zfill(DIGITS + 1)[::-1]}" for x, y in zip(a, b)]
    chars = np.array([[VOCAB.index(c) for c in t] for t in text], dtype=np.int32)  # (N, 3*DIGITS+3)
    inputs, labels = chars[:, :-1], chars[:, 1:].copy()
    labels[:, :2 * DIGITS + 1] = -100   # positions before '=' predict operand digits: random, not scored
    return pa.table({
        "id": pa.array(ids, pa.int64()),
        "input_ids": pa.FixedSizeListArray.from_arrays(pa.array(inputs.ravel()), inputs.shape[1]),
        "labels": pa.FixedSizeListArray.from_arrays(pa.array(labels.ravel()), labels.shape[1]),
    })


def _draw(rng: np.random.Generator, shape: int) -> np.ndarray:
    img = rng.integers(0, 60, size=(32, 32, 3), dtype=np.uint8)
    colour = rng.integers(120, 256, size=3, dtype=np.uint8)
    r = int(rng.integers(6, 12))
    cy, cx = rng.integers(r, 32 - r, size=2)
    yy, xx = np.mgrid[0:32, 0:32]
    dy, dx = yy - cy, xx - cx
    mask = {
        0: dy ** 2 + dx ** 2 <= r * r,
        1: (abs(dy) <= r * 0.8) & (abs(dx) <= r * 0.8),
        2: ((abs(dy) <= 2) & (abs(dx) <= r)) | ((abs(dx) <= 2) & (abs(dy) <= r)),
        3: (abs(dy) <= r) & (abs(dx) <= r) & ((yy // 3) % 2 == 0),
    }[shape]
    img[mask] = colour
    return img.transpose(2, 0, 1)  # (3, 32, 32)


def shapes_table(ids: np.ndarray, seed: int) -> pa.Table:
    rng = np.random.default_rng([seed, int(ids[0]) if len(ids) else 0])
    labels = rng.integers(0, len(SHAPES), size=len(ids))
    images = np.stack([_draw(rng, int(s)) for s in labels]).reshape(len(ids), -1)
    return pa.table({
        "id": pa.array(ids, pa.int64()),
        "image": pa.FixedSizeListArray.from_arrays(pa.array(images.ravel()), images.shape[1]),
        "label": pa.array(labels, pa.int64()),
    })


GENERATORS = {"tokens": (arithmetic_table, TOKENS_META), "images": (shapes_table, IMAGES_META)}
