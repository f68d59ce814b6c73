"""The model a run trains: its spec (from `model.name`, or a `ModelSpec` object given to
`raydl.train(model=...)`) with its options (from `model.options`), and what the driver and the
workers ask of it: the dataset it needs, the built model, its checkpoint fingerprint, its FLOPs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from raydl.config import JobConfig, ModelSection
from raydl.data.dataset import (
    DatasetInfo,
    check_columns,
    check_task,
    open_dataset,
    resolve_path,
)
from raydl.errors import ConfigError, DataError
from raydl.models.blocks import BlockModel, num_params
from raydl.models.build import build_model
from raydl.models.options import build_options
from raydl.models.registry import import_dir, resolve_spec
from raydl.models.spec import ModelSpec


@dataclass(frozen=True)
class ModelChoice:
    spec: ModelSpec
    options: Any
    size: str      # model.size: part of the checkpoint fingerprint, as before model.options existed
    import_dir: str = ""   # where model.name's module was found: the workers import it from there

    def open_dataset(self, cfg: JobConfig) -> DatasetInfo:
        """data.path (or the built-in dataset of the model's task, generated on first use), opened and checked."""
        info = open_dataset(self._data_path(cfg))
        self.check_data(info)
        return info

    def _data_path(self, cfg: JobConfig) -> str:
        if cfg.data.path == "builtin" and self.spec.task is None:
            raise ConfigError("data.path", f"is 'builtin', but model '{self.spec.name}' names no task, so raydl has "
                              "no built-in dataset for it", "prepare a dataset with `raydl data prepare` and set "
                              "data.path to its directory")
        return resolve_path(cfg, self.spec.task)

    def check_data(self, info: DatasetInfo) -> None:
        """The dataset holds the task and the columns the spec reads (before any worker starts)."""
        if self.spec.task is not None:
            check_task(info, self.spec.task, self.spec.name)
        check_columns(info, self.spec.columns, self.spec.name)
        if (info.meta.get("records") or {}).get("packed") and self.spec.forward_kwargs is None:
            raise DataError(f"dataset '{info.root}' holds packed rows (raydl data prepare --pack: several records per "
                            f"row), but model '{self.spec.name}' takes no document ids (ModelSpec.forward_kwargs), so "
                            f"its records would attend to each other. Fix: prepare the records without --pack, or "
                            f"give the spec forward_kwargs=raydl.models.packing.packed_kwargs and mask attention per "
                            f"record as raydl's gpt does.")

    def build(self, meta: dict[str, Any], *, pp_degree: int | str = 1) -> BlockModel:
        """The BlockModel (on the current default device: "meta" counts without allocating)."""
        return build_model(self.spec, self.options, meta, pp_degree=pp_degree)

    def check_blocks(self, meta: dict[str, Any]) -> None:
        """A plain module's `blocks` reproduce its forward (ConfigError if not). This builds the whole model with
        real values, so it runs once, in the one process that prepares the run (the driver; torchrun's rank 0)
        and never in a worker that builds on meta."""
        build_model(self.spec, self.options, meta, pp_degree=1)

    def fingerprint(self, model: BlockModel) -> dict[str, Any]:
        """What a checkpoint records of the model, so that resuming with another one is refused."""
        return {"name": self.spec.name, "size": self.size, "params": num_params(model), "blocks": len(model.blocks)}

    def flops_per_sample(self, meta: dict[str, Any]) -> float | None:
        return self.spec.flops_per_sample(self.options, meta) if self.spec.flops_per_sample else None


def choose_model(section: ModelSection, spec: ModelSpec | None = None) -> ModelChoice:
    """`spec` (from raydl.train(model=...)) replaces the one model.name names."""
    if spec is not None:
        return ModelChoice(spec, build_options(spec, section), section.size)
    spec = resolve_spec(section.name)
    return ModelChoice(spec, build_options(spec, section), section.size, import_dir(section.name))
