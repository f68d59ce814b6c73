"""Write a numeric parquet table for examples/mlp_regressor.py: the kind of table you bring yourself.

    python examples/make_table.py data/raw/table.parquet --rows 8192
    raydl data prepare --from parquet data/raw/table.parquet --out data/table

Columns: `features` (8 float32 values per row, a fixed-size list), `target` (a float32 scalar,
a fixed linear function of the features plus a little noise), `tags` (a variable-length list of
int64, which the regressor ignores) and `name` (a string, which no model can read). raydl keeps
them all; a spec says in `columns` which it reads.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

FEATURES = 8


def make_table(rows: int, seed: int = 0) -> pa.Table:
    rng = np.random.default_rng(seed)
    features = rng.standard_normal((rows, FEATURES), dtype=np.float32)
    weights = np.linspace(-1.0, 1.0, FEATURES, dtype=np.float32)
    target = features @ weights + 0.5 * np.sin(features[:, 0]) + 0.05 * rng.standard_normal(rows, dtype=np.float32)
    tags = [rng.integers(0, 100, size=rng.integers(0, 6)).tolist() for _ in range(rows)]
    return pa.table({
        "features": pa.FixedSizeListArray.from_arrays(pa.array(features.ravel()), FEATURES),
        "target": pa.array(target.astype(np.float32)),
        "tags": pa.array(tags, pa.list_(pa.int64())),
        "name": pa.array([f"row-{i}" for i in range(rows)]),
    })


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out", help="The parquet file to write.")
    parser.add_argument("--rows", type=int, default=8192, help="Rows (default 8192).")
    parser.add_argument("--seed", type=int, default=0, help="Random seed (default 0).")
    args = parser.parse_args()
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(make_table(args.rows, args.seed), args.out)
    print(f"wrote {args.out}: {args.rows} rows")


if __name__ == "__main__":
    main()
