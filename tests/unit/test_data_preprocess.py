"""Image augmentation: a pure function of (seed, epoch, sample id), whatever the batch it is in."""

from __future__ import annotations

import numpy as np
import pyarrow as pa

from raydl.data.preprocess import SHIFT, augment_images, make_preprocess

SHAPE = (3, 16, 16)


def images(ids: np.ndarray) -> pa.Table:
    x = np.zeros((len(ids), *SHAPE), np.uint8)
    x[:, :, 8, 5] = 200                                   # one bright pixel per image, left of centre
    return pa.table({"id": pa.array(ids, pa.int64()),
                     "image": pa.FixedSizeListArray.from_arrays(pa.array(x.ravel()), int(np.prod(SHAPE)))})


def pixels(table: pa.Table) -> np.ndarray:
    return table["image"].combine_chunks().flatten().to_numpy().reshape(len(table), *SHAPE)


def test_same_row_same_augmentation_in_any_batch_and_new_per_epoch():
    ids = np.arange(64)
    whole = pixels(augment_images(images(ids), 0, image_shape=SHAPE, seed=1))
    halves = np.concatenate([pixels(augment_images(images(part), 0, image_shape=SHAPE, seed=1))
                             for part in (ids[40:], ids[:40])])
    assert np.array_equal(whole, np.concatenate([halves[24:], halves[:24]]))
    assert not np.array_equal(whole, pixels(augment_images(images(ids), 1, image_shape=SHAPE, seed=1)))
    assert not np.array_equal(whole, pixels(augment_images(images(ids), 0, image_shape=SHAPE, seed=2)))


def test_images_are_flipped_and_shifted_by_at_most_shift_pixels():
    out = pixels(augment_images(images(np.arange(256)), 0, image_shape=SHAPE, seed=0))
    ys, xs = [], []
    for image in out:
        where = np.argwhere(image[0] == 200)
        assert len(where) <= 1 and (image[0] != 0).sum() == len(where)     # moved, not smeared or duplicated
        if len(where):
            ys.append(where[0][0] - 8)
            xs.append(where[0][1])
    assert max(map(abs, ys)) <= SHIFT and len(set(ys)) > 5
    flipped = [x for x in xs if x > 7]                  # the pixel started at column 5: right half means flipped
    assert 0.3 < len(flipped) / len(xs) < 0.7


def test_only_image_datasets_are_augmented():
    assert make_preprocess({"task": "tokens"}, augment=True, seed=0) is None
    assert make_preprocess({"task": "images", "image_shape": list(SHAPE)}, augment=False, seed=0) is None
    assert make_preprocess({"task": "images", "image_shape": list(SHAPE)}, augment=True, seed=0)
