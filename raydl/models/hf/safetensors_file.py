"""A safetensors file read without mapping it: its header checked, then one tensor's region read with `readinto`
straight into the storage of the tensor that keeps it.

    read_header(path)                      name -> Stored(shape, dtype, start, nbytes); ValueError naming the tensor
    read_region(path, stored, region, out) this rank's region of a tensor into `out` (allocated already)

Why not the safetensors package: `safe_open` maps the whole file, and every page a slice touches is counted in
the worker's resident memory until the file is closed (an FSDP2 rank's half of a 49,152-row embedding: as much
again as it owns), and it can only return a new tensor, which is then copied. The format is small enough to read
here: an 8-byte little-endian header length, a JSON header (name -> dtype, shape, data_offsets into the bytes
after it), then each tensor's bytes, row-major and little-endian. The file is untrusted, so every field is
checked against the file's size before any byte of data is read.

A region (an FSDP2 shard's rows, or a whole tensor for a pipeline stage) is a box of the tensor; its rows are
contiguous runs in the file (one run for rows of dim 0), read in order into `out`'s bytes. When the file's dtype
differs from `out`'s (a bf16 checkpoint into fp32 parameters) or `out` is not in host memory, the runs go
through a buffer of at most CHUNK bytes and are converted chunk by chunk: the extra memory is the buffer, never
a tensor.
"""

from __future__ import annotations

import itertools
import json
import math
import struct
from pathlib import Path
from typing import BinaryIO, NamedTuple

import torch

__all__ = ["Stored", "FLOATS", "read_header", "read_region"]

MAX_HEADER = 100 * 2**20   # bytes: a header is JSON of names, dtypes, shapes and offsets
CHUNK = 4 * 2**20          # bytes: the conversion buffer
FLOATS = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}
# Bytes per element of the whole-byte dtypes safetensors writes; others (sub-byte floats) are only bounds-checked
# here, and refused by the weights check if a model needs one.
_ITEM_BYTES = {"BOOL": 1, "U8": 1, "I8": 1, "F8_E5M2": 1, "F8_E4M3": 1, "F8_E8M0": 1, "I16": 2, "U16": 2, "F16": 2,
               "BF16": 2, "I32": 4, "U32": 4, "F32": 4, "I64": 8, "U64": 8, "F64": 8}


class Stored(NamedTuple):
    """Where one tensor lies in its file: `start` is the absolute offset of its first byte."""

    shape: tuple[int, ...]
    dtype: str
    start: int
    nbytes: int


def read_header(path: Path) -> dict[str, Stored]:
    """Every tensor of a safetensors file, checked: known fields, offsets inside the file, byte counts that match
    the shapes, no two tensors sharing a byte. ValueError (naming the tensor) otherwise; no data is read."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise ValueError(f"{size} bytes, less than the 8-byte header length")
        (length,) = struct.unpack("<Q", head)
        if length > min(MAX_HEADER, size - 8):
            raise ValueError(f"header length {length} in a file of {size} bytes")
        try:
            header = json.loads(f.read(length))
        except RecursionError:
            raise ValueError("the header nests JSON too deeply") from None
    if not isinstance(header, dict):
        raise ValueError("the header is not a JSON object")
    tensors = {name: _stored(name, entry, 8 + length, size - 8 - length)
               for name, entry in header.items() if name != "__metadata__"}
    spans = sorted((s.start, s.start + s.nbytes, name) for name, s in tensors.items() if s.nbytes)
    for (_, end, first), (begin, _, second) in zip(spans, spans[1:]):
        if begin < end:
            raise ValueError(f"tensors '{first}' and '{second}' share bytes")
    return tensors


def _stored(name: str, entry: object, data_start: int, data_bytes: int) -> Stored:
    if not isinstance(entry, dict):
        raise ValueError(f"tensor '{name}' is not described by a JSON object")
    dtype, shape, offsets = entry.get("dtype"), entry.get("shape"), entry.get("data_offsets")
    if not isinstance(dtype, str) or not isinstance(shape, list) or not all(_count(n) for n in shape):
        raise ValueError(f"tensor '{name}' has dtype {str(dtype)[:20]} and shape {str(shape)[:60]}")
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(_count(n) for n in offsets)
            and offsets[0] <= offsets[1] <= data_bytes):
        raise ValueError(f"tensor '{name}' has data_offsets {str(offsets)[:60]} outside the file's {data_bytes} "
                         "bytes of data")
    nbytes = offsets[1] - offsets[0]
    if dtype in _ITEM_BYTES and nbytes != math.prod(shape) * _ITEM_BYTES[dtype]:
        raise ValueError(f"tensor '{name}' is {dtype} {shape} ({math.prod(shape) * _ITEM_BYTES[dtype]} bytes) "
                         f"but its data_offsets span {nbytes}")
    return Stored(tuple(shape), dtype, data_start + offsets[0], nbytes)


def _count(n: object) -> bool:
    return isinstance(n, int) and not isinstance(n, bool) and n >= 0


def read_region(path: Path, stored: Stored, region: tuple[slice, ...] | None, out: torch.Tensor) -> None:
    """Read `region` (None: all) of a float tensor stored in `path` into `out`, which has the region's shape.
    ValueError if the file ends before the tensor does (it changed since its header was read)."""
    source = FLOATS[stored.dtype]
    region = region or tuple(slice(0, n) for n in stored.shape)
    # A non-contiguous `out` (no layout raydl applies makes one) is read into a contiguous twin, then copied.
    dest = out if out.is_contiguous() else torch.empty(out.shape, dtype=out.dtype, device=out.device)
    flat = dest.detach().reshape(-1)
    runs = _runs(stored.shape, region, source.itemsize)
    with open(path, "rb", buffering=0) as f:
        if flat.device.type == "cpu" and flat.dtype == source:
            _read_into(f, stored, runs, _bytes_of(flat))
        else:
            _read_converted(f, stored, runs, flat, source)
    if dest is not out:
        out.copy_(dest)


def _runs(shape: tuple[int, ...], region: tuple[slice, ...], itemsize: int) -> list[tuple[int, int]]:
    """(byte offset within the tensor, byte length) of each contiguous run of a box of a row-major tensor, in
    row-major order; dims the box spans whole join their runs, so rows of dim 0 are one run."""
    strides = [math.prod(shape[d + 1:]) * itemsize for d in range(len(shape))]
    k = len(shape)
    while k and (region[k - 1].start, region[k - 1].stop) == (0, shape[k - 1]):
        k -= 1
    if k == 0:
        return [(0, math.prod(shape) * itemsize)] if math.prod(shape) else []
    inner = region[k - 1]
    length = (inner.stop - inner.start) * strides[k - 1]
    if not length:
        return []
    outer = itertools.product(*(range(r.start, r.stop) for r in region[:k - 1]))
    return [(sum(i * s for i, s in zip(index, strides)) + inner.start * strides[k - 1], length) for index in outer]


def _bytes_of(flat: torch.Tensor) -> memoryview:
    """The bytes of a contiguous 1-D host tensor, writable in place (numpy shares the storage)."""
    return memoryview(flat.view(torch.uint8).numpy())


def _read_into(f: BinaryIO, stored: Stored, runs: list[tuple[int, int]], target: memoryview) -> None:
    done = 0
    for offset, length in runs:
        f.seek(stored.start + offset)
        _read_exactly(f, target[done:done + length], stored)
        done += length


def _read_converted(f: BinaryIO, stored: Stored, runs: list[tuple[int, int]], flat: torch.Tensor,
                    source: torch.dtype) -> None:
    buffer = torch.empty(CHUNK // source.itemsize, dtype=source)
    raw = _bytes_of(buffer)
    done = 0   # elements of `flat` written
    for offset, length in runs:
        f.seek(stored.start + offset)
        for begin in range(0, length, CHUNK):
            size = min(CHUNK, length - begin)
            _read_exactly(f, raw[:size], stored)
            n = size // source.itemsize
            flat[done:done + n].copy_(buffer[:n])
            done += n


def _read_exactly(f: BinaryIO, target: memoryview, stored: Stored) -> None:
    # readinto may return less than asked (Linux caps one read at ~2 GiB): loop until full or the file ends.
    while len(target):
        got = f.readinto(target)
        if not got:
            raise ValueError(f"the file ends inside a tensor at byte {f.tell()} (it starts at {stored.start}, "
                             f"{stored.nbytes} bytes): it changed after its header was read")
        target = target[got:]
