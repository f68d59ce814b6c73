"""The safetensors reader of model.options.weights: a region read straight into the destination's storage equals
safetensors' own load to the bit (bf16 into fp32 included), costs no copy of the tensor or of its slice (the
process's peak resident memory while reading a 48 MiB tensor's half), and a file whose header lies is refused
naming the file and the tensor."""

from __future__ import annotations

import json
import re
import struct

import pytest
import torch
from safetensors.torch import load_file, save_file

from raydl.errors import ConfigError
from raydl.models.hf.safetensors_file import read_header, read_region
from raydl.models.hf.weights import WeightsIndex


@pytest.fixture
def stored(tmp_path):
    g = torch.Generator().manual_seed(0)
    tensors = {"f32": torch.randn(37, 5, 3, generator=g), "bf16": torch.randn(41, 9, generator=g).bfloat16(),
               "f16": torch.randn(6, 11, generator=g).half(), "scalar": torch.tensor(2.5), "empty": torch.zeros(0, 4)}
    path = tmp_path / "model.safetensors"
    save_file(tensors, path)
    return path


REGIONS = {"f32": [None, (slice(10, 19), slice(0, 5), slice(0, 3)), (slice(3, 7), slice(1, 4), slice(0, 3)),
                   (slice(0, 37), slice(0, 5), slice(2, 3)), (slice(37, 37), slice(0, 5), slice(0, 3))],
           "bf16": [None, (slice(20, 41), slice(0, 9)), (slice(0, 41), slice(4, 6))],
           "f16": [None, (slice(5, 6), slice(0, 11))], "scalar": [None, ()], "empty": [None]}


@pytest.mark.parametrize("into", [None, torch.float32, torch.float64])
def test_every_region_equals_safetensors_own_load_to_the_bit(stored, into):
    header, reference = read_header(stored), load_file(stored)
    for name, regions in REGIONS.items():
        for region in regions:
            want = reference[name][region] if region is not None else reference[name]
            want = want.to(into) if into is not None else want
            out = torch.full_like(want, float("nan"))
            pointer = out.data_ptr()
            read_region(stored, header[name], region, out)
            assert out.data_ptr() == pointer and out.dtype == want.dtype
            assert torch.equal(out.view(-1).view(torch.uint8), want.contiguous().view(-1).view(torch.uint8)), (name, region)


def test_a_non_contiguous_destination_is_filled_too(stored):
    out = torch.full((3, 37, 5), float("nan")).permute(1, 2, 0)
    read_region(stored, read_header(stored)["f32"], None, out)
    assert torch.equal(out, load_file(stored)["f32"])


def _status(key: str) -> int:
    return int(re.search(rf"{key}:\s+(\d+) kB", open("/proc/self/status").read()).group(1)) * 1024


@pytest.mark.parametrize("file_dtype", [torch.float32, torch.bfloat16])
def test_reading_half_the_rows_of_a_48_mib_tensor_adds_no_copy_of_them(tmp_path, file_dtype):
    """Peak resident memory while reading 24 MiB of rows into fp32 storage that exists already: below 6 MiB more
    (the 4 MiB conversion buffer and the interpreter's own noise). Mapping the file and slicing it, as
    safetensors' get_slice does, adds the mapped rows and the slice: 48 MiB for fp32."""
    path = tmp_path / "big.safetensors"
    rows = 12288
    save_file({"w": torch.randn(rows, 1024, generator=torch.Generator().manual_seed(1)).to(file_dtype)}, path)
    stored = read_header(path)["w"]
    out = torch.zeros(rows // 2, 1024)   # zeros touch every page: they count before the read
    open("/proc/self/clear_refs", "w").write("5")   # the peak (VmHWM) starts again from the current size
    before = _status("VmRSS")
    read_region(path, stored, (slice(rows // 2, rows), slice(0, 1024)), out)
    extra = _status("VmHWM") - before
    assert extra < 6 * 2**20, f"reading 24 MiB of rows raised the peak by {extra / 2**20:.1f} MiB"
    assert torch.equal(out, load_file(path)["w"][rows // 2:].float())


def _write(path, header: dict, data: bytes) -> None:
    text = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(text)) + text + data)


@pytest.mark.parametrize("header, problem", [
    ({"a": {"dtype": "F32", "shape": [2, 2], "data_offsets": [0, 16]},
      "b": {"dtype": "F32", "shape": [2], "data_offsets": [8, 16]}}, r"tensors 'a' and 'b' share bytes"),
    ({"a": {"dtype": "F32", "shape": [2, 3], "data_offsets": [0, 24]}}, r"tensor 'a' has data_offsets \[0, 24\] "
                                                                         r"outside the file's 16 bytes"),
    ({"a": {"dtype": "F32", "shape": [2, 3], "data_offsets": [0, 16]}}, r"tensor 'a' is F32 \[2, 3\] \(24 bytes\) "
                                                                         r"but its data_offsets span 16"),
    ({"a": {"dtype": "F32", "shape": [-2], "data_offsets": [0, 16]}}, r"tensor 'a' has dtype F32 and shape \[-2\]"),
    ({"a": {"dtype": "F32", "shape": [4], "data_offsets": [12, 4]}}, r"tensor 'a' has data_offsets \[12, 4\]"),
])
def test_a_header_that_lies_is_refused_naming_the_file_and_the_tensor(tmp_path, header, problem):
    _write(tmp_path / "model.safetensors", header, bytes(16))
    with pytest.raises(ConfigError, match=rf"'model.safetensors' is not a readable safetensors file .*{problem}"):
        WeightsIndex(tmp_path)


def test_a_header_nested_past_the_interpreter_s_limit_is_refused(tmp_path):
    text = b"[" * 200_000 + b"]" * 200_000
    (tmp_path / "model.safetensors").write_bytes(struct.pack("<Q", len(text)) + text)
    with pytest.raises(ConfigError, match=r"'model.safetensors' is not a readable safetensors file .*too deeply"):
        WeightsIndex(tmp_path)


def test_a_file_cut_after_its_header_was_read_is_refused_at_the_read(stored):
    header = read_header(stored)
    stored.write_bytes(stored.read_bytes()[:header["bf16"].start + 10])
    with pytest.raises(ValueError, match=r"the file ends inside a tensor"):
        read_region(stored, header["bf16"], None, torch.empty(41, 9, dtype=torch.bfloat16))
