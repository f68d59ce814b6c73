"""Local Hugging Face safetensors weights, read per rank: each tensor's own rows, never the whole model.

    check_weights(directory, expected)    the driver (and every worker): headers only, before any tensor is read
    SafetensorsSource(directory, ...)     a worker: `fill(module)` reads a module's tensors into what this rank
                                          holds of them (an FSDP2 shard: its rows), with `read_region`

A module is filled after the layout is applied and its tensors allocated (`raydl.parallel.materialize`), so
a pipeline stage reads only its own layers' tensors and an FSDP2 shard only its rows, each straight into its
own storage (`raydl.models.hf.safetensors_file`: no mapping, no copy): a rank holds what it owns plus a 4 MiB
buffer when a dtype is converted. Files are untrusted: their headers are parsed with bounds on every length
and offset, only names of the index's own directory are opened, and safetensors holds no code.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from raydl.errors import ConfigError
from raydl.models.hf.safetensors_file import FLOATS, Stored, read_header, read_region

__all__ = ["WeightsIndex", "check_weights", "expected_tensors", "SafetensorsSource"]

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
FIELD = "model.options.weights"
RESAVE = "re-save the model with save_pretrained (safetensors, its default)"


class WeightsIndex:
    """Which file of a weights directory holds each tensor, and its shape and dtype (from the headers)."""

    def __init__(self, directory: str | Path):
        self.folder = Path(directory).expanduser()
        self.tensors: dict[str, tuple[str, Stored]] = {}   # name -> (file, where in it)
        for name in self._files():
            for key, stored in _header(self.folder / name).items():
                self.tensors[key] = (name, stored)

    def _files(self) -> list[str]:
        index = self.folder / INDEX
        if index.is_file():
            try:
                listed = json.loads(index.read_text())["weight_map"]
                names = sorted(set(listed.values()))
            except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
                raise ConfigError(FIELD, f"has an unreadable {INDEX} ({e})", RESAVE) from None
            outside = [n for n in names if not isinstance(n, str) or Path(n).name != n]
            missing = [n for n in names if n not in outside and not (self.folder / n).is_file()]
            if outside:
                raise ConfigError(FIELD, f"{INDEX} names {outside[:3]}, which are not files of '{self.folder}'",
                                  RESAVE)
            if missing:
                raise ConfigError(FIELD, f"'{self.folder}' misses {len(missing)} of the {len(names)} shard files "
                                  f"its {INDEX} names: {', '.join(missing[:3])}", "copy the missing shards into "
                                  "the directory (a download may have stopped early), or " + RESAVE)
            return names
        if (self.folder / SINGLE).is_file():
            return [SINGLE]
        raise ConfigError(FIELD, f"'{self.folder}' holds no {SINGLE} (or its sharded {INDEX}); raydl loads only "
                          "safetensors, never pickled .bin files", RESAVE)


def _header(path: Path) -> dict[str, Stored]:
    """The checked header of one file (`read_header`), its problems as the field's error."""
    try:
        return read_header(path)
    except (OSError, ValueError) as e:
        raise _unreadable(path, e) from None


def _unreadable(path: Path, e: Exception) -> ConfigError:
    return ConfigError(FIELD, f"'{path.name}' is not a readable safetensors file ({type(e).__name__}: "
                       f"{str(e)[:200]})", RESAVE)


def check_weights(directory: str, expected: dict[str, tuple[int, ...]], aliases: dict[str, str]) -> WeightsIndex:
    """Refuse a weights directory that lacks a tensor the model needs, or holds one of another shape or a
    non-float dtype (headers only). `expected`: name -> shape; `aliases`: a name that, when absent, is read
    from another (a tied head from the embeddings)."""
    index = WeightsIndex(directory)
    missing, wrong = [], []
    for name, shape in expected.items():
        found = index.tensors.get(name) or index.tensors.get(aliases.get(name, ""))
        if found is None:
            missing.append(name)
        elif found[1].shape != tuple(shape) or found[1].dtype not in FLOATS:
            wrong.append(f"{name} is {found[1].dtype} {list(found[1].shape)}, the model's is {list(shape)}")
    if missing:
        raise ConfigError(FIELD, f"'{index.folder}' lacks {len(missing)} of the model's {len(expected)} tensors "
                          f"(first: {', '.join(missing[:3])})", "pass the complete directory save_pretrained "
                          "wrote for this config.json (a shard may be missing or truncated)")
    if wrong:
        raise ConfigError(FIELD, f"'{index.folder}' does not fit its config.json: {'; '.join(wrong[:3])}",
                          "pass weights saved from the model this config.json describes, in a float dtype")
    return index


class SafetensorsSource:
    """Fills modules from a weights directory by their Hugging Face names (`hf_names`: module -> its name in
    the transformers model). A module is filled only when every tensor it owns directly is in the files
    (non-persistent buffers, such as rotary inv_freq, are computed by the model's init instead)."""

    def __init__(self, index: WeightsIndex, hf_names: dict[nn.Module, str], aliases: dict[str, str]):
        self.index, self.hf_names, self.aliases = index, hf_names, aliases

    def _key(self, name: str) -> str | None:
        if name in self.index.tensors:
            return name
        alias = self.aliases.get(name)
        return alias if alias in self.index.tensors else None

    def keys(self, module: nn.Module) -> dict[str, str] | None:
        """attribute -> the tensor name in the files for each tensor `module` owns directly; None if any lacks one."""
        prefix = self.hf_names.get(module)
        if prefix is None:
            return None
        owned = {**module._parameters, **module._buffers}
        keys = {attr: self._key(f"{prefix}.{attr}" if prefix else attr) for attr, t in owned.items() if t is not None}
        return keys if keys and all(keys.values()) else None

    @torch.no_grad()
    def fill(self, module: nn.Module) -> bool:
        """Read this rank's part of each of `module`'s tensors from the files into its storage; False (nothing
        read) if it has a tensor the files lack."""
        keys = self.keys(module)
        if keys is None:
            return False
        for attr, key in keys.items():
            local, region = _local_region(getattr(module, attr))
            file, stored = self.index.tensors[key]
            path = self.index.folder / file
            try:
                read_region(path, stored, region, local)
            except (OSError, ValueError) as e:
                raise _unreadable(path, ValueError(f"tensor '{key}': {e}")) from None
        return True


def _local_region(t: torch.Tensor) -> tuple[torch.Tensor, tuple[slice, ...] | None]:
    """(what this rank holds of `t`, its region of the whole tensor; None = all of it)."""
    if not isinstance(t, DTensor):
        return t, None
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    shape, offset = compute_local_shape_and_global_offset(t.shape, t.device_mesh, t.placements)
    return t.to_local(), tuple(slice(o, o + n) for o, n in zip(offset, shape))


def expected_tensors(model: nn.Module) -> dict[str, tuple[int, ...]]:
    """The persistent tensors a transformers model loads, by name, with their shapes (works on meta)."""
    return {name: tuple(t.shape) for name, t in model.state_dict().items()}

