"""Per-batch preprocessing of training rows: one function for both readers.

data.backend=ray runs it in Ray Data's `map_batches`, fused into the read tasks, so it uses
the cluster's CPUs instead of the training process; data.backend=arrow runs it in the
loader's prefetch thread.

- Images: a random horizontal flip and a random shift of up to `SHIFT` pixels (zero fill),
  drawn from (seed, epoch, sample id) only, so a row gets the same augmentation wherever and
  whenever it is read: on any rank, after a restart or a resize, through either backend.
  Normalisation stays on the device (`ModelSpec.prepare`): uint8 pixels cross to the GPU at a
  quarter of the float32 size.
- Tokens: nothing here. Text is packed into fixed rows of `seq_len` at prepare time, because
  a sample id must name one fixed row for the exactly-once ledger; packing at read time would
  make the rows depend on where reading started.
"""

from __future__ import annotations

import functools
from typing import Callable

import numpy as np
import pyarrow as pa

SHIFT = 4


def make_preprocess(meta: dict, *, augment: bool, seed: int) -> Callable[[pa.Table, int], pa.Table] | None:
    """`fn(table, epoch)` to apply to each batch of training rows, or None when there is nothing to do."""
    if meta["task"] == "images" and augment:
        return functools.partial(augment_images, image_shape=tuple(meta["image_shape"]), seed=seed)
    return None


def augment_images(table: pa.Table, epoch: int, *, image_shape: tuple[int, int, int], seed: int) -> pa.Table:
    column = table.column("image").combine_chunks()
    images = column.flatten().to_numpy().reshape(len(table), *image_shape)
    draws = _mix(table.column("id").to_numpy(), seed, epoch)
    out = np.zeros_like(images)
    height, width = image_shape[1:]
    for i, draw in enumerate(draws):
        image = images[i, :, :, ::-1] if draw & 1 else images[i]
        dy, dx = int(draw >> 8) % (2 * SHIFT + 1) - SHIFT, int(draw >> 16) % (2 * SHIFT + 1) - SHIFT
        out[i, :, max(dy, 0):height + min(dy, 0), max(dx, 0):width + min(dx, 0)] = \
            image[:, max(-dy, 0):height - max(dy, 0), max(-dx, 0):width - max(dx, 0)]
    flat = pa.FixedSizeListArray.from_arrays(pa.array(out.ravel()), column.type.list_size)
    return table.set_column(table.schema.get_field_index("image"), "image", flat)


def _mix(ids: np.ndarray, seed: int, epoch: int) -> np.ndarray:
    """splitmix64 of (id, seed, epoch): independent random bits per row, no shared RNG state."""
    with np.errstate(over="ignore"):
        z = ids.astype(np.uint64) + np.uint64((seed * 1_000_003 + epoch) * 0x9E3779B97F4A7C15 % 2 ** 64)
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return z ^ (z >> np.uint64(31))
