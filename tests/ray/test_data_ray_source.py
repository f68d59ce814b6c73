"""data.backend=ray reads the same rows, in the same order, at the same positions as the arrow backend."""

from __future__ import annotations

import pytest

from raydl.data.dataset import open_dataset
from raydl.data.loader import StepLoader
from raydl.data.order import DataPosition
from tests.unit.test_data_loader import make_dataset

pytestmark = pytest.mark.slow


def steps(path, backend: str, dp_rank: int, position: DataPosition, n: int) -> list[tuple]:
    loader = StepLoader(open_dataset(str(path)), global_batch=64, dp_rank=dp_rank, dp_size=2, seed=3, shuffle=True,
                        position=position, prefetch=2, backend=backend)
    return [(b.position, b.tensors["id"].tolist(), b.tensors["input_ids"].sum().item())
            for b, _ in zip(loader, range(n))]


def test_ray_backend_matches_arrow_from_a_mid_epoch_position(ray_session, tmp_path):
    path = make_dataset(tmp_path)                     # 2048 rows, 32 steps per epoch
    start = DataPosition(0, 20 * 64)                  # resume mid-epoch, run into the next epoch
    for rank in (0, 1):
        assert steps(path, "ray", rank, start, 16) == steps(path, "arrow", rank, start, 16)
