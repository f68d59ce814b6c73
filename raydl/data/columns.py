"""Which parquet columns become batch tensors, and their shapes.

A model reads numbers: a column is a tensor when it holds integers, floats or booleans, as a
scalar per row, a fixed-size list (rows, size), or a variable-length list, padded per batch to
the batch's longest row with a `<column>_mask` bool tensor marking the real values. Anything
else (strings, structs, maps, nested lists) stays in the dataset but no spec can read it.
"""

from __future__ import annotations

from typing import Any

import pyarrow as pa

MASK_SUFFIX = "_mask"
VARIABLE = -1    # the shape entry of a variable-length list column in the manifest's `columns`
# Packed rows (raydl data prepare --pack): per token, which of the row's records it belongs to (0, 1, 2...)
DOCUMENTS = "document_ids"


def _is_number(kind: pa.DataType) -> bool:
    return pa.types.is_integer(kind) or pa.types.is_floating(kind) or pa.types.is_boolean(kind)


def is_variable_list(kind: pa.DataType) -> bool:
    return pa.types.is_list(kind) or pa.types.is_large_list(kind)


def tensor_shape(kind: pa.DataType) -> list[int] | None:
    """A column's per-row shape ([] scalar, [n] fixed, [VARIABLE] variable), or None when it is no tensor."""
    if _is_number(kind):
        return []
    if pa.types.is_fixed_size_list(kind) and _is_number(kind.value_type):
        return [kind.list_size]
    if is_variable_list(kind) and _is_number(kind.value_type):
        return [VARIABLE]
    return None


def describe(schema: pa.Schema) -> dict[str, dict[str, Any]]:
    """{column: {"dtype", "shape"}} of the tensor columns: what a table's manifest tells the model's build."""
    out = {}
    for field in schema:
        shape = tensor_shape(field.type)
        if shape is not None:
            value_type = field.type if shape == [] else field.type.value_type
            out[field.name] = {"dtype": numpy_name(value_type), "shape": shape}
    return out


def numpy_name(kind: pa.DataType) -> str:
    """The numpy dtype name of a number type ("int64", "float16", "bool"), without pyarrow's `to_pandas_dtype`,
    which imports pandas (0.3 s in a process that otherwise never needs it: a torchrun rank, `raydl export`)."""
    if pa.types.is_boolean(kind):
        return "bool"
    prefix = "float" if pa.types.is_floating(kind) else "int" if pa.types.is_signed_integer(kind) else "uint"
    return f"{prefix}{kind.bit_width}"
