"""Image folders -> rows of 3x32x32 uint8 pixels and a class label, for `raydl data prepare`.

One class per subfolder (sorted names); images are resized with Pillow. The file list is
shuffled with a fixed seed first, so a class is not one long run of rows.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Iterator

import numpy as np
import pyarrow as pa

from raydl.data.input_files import Progress
from raydl.errors import DataError, one_line

IMAGE_SIZE = 32
IMAGE_EXTS = {".png", ".jpg", ".jpeg", ".bmp", ".gif", ".webp", ".ppm", ".tif", ".tiff"}


def image_rows(files: list[Path], root: Path, progress: Progress) -> tuple[Iterator[pa.Table], list[str]]:
    labelled = [(p, p.relative_to(root).parts[0]) for p in files
                if p.suffix.lower() in IMAGE_EXTS and len(p.relative_to(root).parts) == 2]
    classes = sorted({c for _, c in labelled})
    if not classes:
        raise DataError(f"--from images '{root}' has no images in class subfolders (expected "
                        f"{root}/<class>/<image>.png|jpg). Fix: put each class's images in its own subfolder.")
    order = np.random.default_rng(0).permutation(len(labelled))
    index = {c: i for i, c in enumerate(classes)}

    def batches() -> Iterator[pa.Table]:
        for start in range(0, len(order), 256):
            chosen = [labelled[i] for i in order[start:start + 256]]
            images = np.stack([_load_image(p) for p, _ in chosen]).reshape(len(chosen), -1)
            progress.update(files=len(chosen), nbytes=sum(p.stat().st_size for p, _ in chosen))
            yield pa.table({"image": pa.FixedSizeListArray.from_arrays(pa.array(images.ravel()), images.shape[1]),
                            "label": pa.array([index[c] for _, c in chosen], pa.int64())})

    return batches(), classes


def _load_image(path: Path) -> np.ndarray:
    from PIL import Image, UnidentifiedImageError

    try:
        with warnings.catch_warnings():
            # Pillow only warns up to twice its pixel limit: a few-KB file can still decode to gigabytes.
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            with Image.open(path) as img:
                rgb = img.convert("RGB").resize((IMAGE_SIZE, IMAGE_SIZE), Image.Resampling.BILINEAR)
                return np.asarray(rgb, dtype=np.uint8).transpose(2, 0, 1)
    except (Image.DecompressionBombError, Image.DecompressionBombWarning) as e:
        raise DataError(f"image '{path}' is too large to decode safely ({one_line(e)}). Fix: remove it, or shrink it below "
                        f"Pillow's limit of {Image.MAX_IMAGE_PIXELS:,} pixels before preparing.") from None
    except (OSError, UnidentifiedImageError) as e:
        raise DataError(f"image '{path}' cannot be read ({one_line(e)}). Fix: remove or replace that file.") from None
