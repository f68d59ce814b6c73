"""raydl's Python API: the runs of `raydl train` and `raydl sweep`, returning their summaries.

    import raydl
    summary = raydl.train("jobs/configs/gpt-tiny.yaml", overrides=["train.max_steps=50"])
    summary = raydl.train({"train": {"max_steps": 50}}, model=my_spec)   # a raydl.ModelSpec defined right here
    report = raydl.sweep("sweep.yaml", model=my_spec)

`config` is a YAML path, a dict of sections (the YAML's shape) or a JobConfig; `overrides` are
`section.key=value` strings (or a {path: value} dict) applied on top. `model` replaces model.name
with a spec object, which travels to the Ray workers pickled (cloudpickle takes functions defined
in a script or notebook by value). Bad input raises raydl.ConfigError, DataError, CheckpointError
or LayoutError (all raydl.RaydlError) before Ray starts; the CLI prints them and exits 2.
"""

from __future__ import annotations

import copy
from pathlib import Path
from collections.abc import Iterable, Mapping
from typing import Any

from raydl.config import JobConfig
from raydl.errors import ConfigError
from raydl.models.spec import ModelSpec
from raydl.overrides import apply_overrides, build_config, read_yaml

Overrides = Iterable[str] | Mapping[str, Any]


def train(config: str | Path | Mapping[str, Any] | JobConfig | None = None, *, overrides: Overrides = (),
          model: ModelSpec | None = None, address: str | None = None, resume: str | None = None) -> dict[str, Any]:
    """Train as `raydl train` does; returns summary.json's dict with `run_dir` and `checkpoint` (the last one)."""
    from raydl.driver.resume import resumed_tree

    tree = _config_tree(config)
    if resume:   # the run's own config is the base (raydl.driver.resume)
        tree = resumed_tree(str(resume), tree)
    tree = apply_overrides(tree, _listed(overrides))
    cfg = build_config(apply_overrides(tree, _model_name(model)))
    # After the config is checked: the driver imports torch (~2 CPU-s), which a mistyped field need not wait for.
    from raydl.driver.ray_trainer import cluster_address, run_training

    return run_training(cfg, address=cluster_address(address), resume=resume, model=model)


def sweep(config: str | Path | Mapping[str, Any] | None = None, *, overrides: Overrides = (),
          model: ModelSpec | None = None, address: str | None = None,
          resume: str | Path | None = None) -> dict[str, Any]:
    """Sweep as `raydl sweep` does; returns results.json's dict (trials, best) with the report table.

    `config`: a sweep file or its mapping (base/space/objective...); None = the built-in batch x
    precision sweep. `overrides` apply to the base training config. `resume`: a sweep directory to
    continue (give `model` again if the sweep had one)."""
    listed = _listed(overrides)
    sets = [*_as_strings(listed), *_as_strings(_model_name(model))]
    if resume and (config is not None or listed):
        raise ConfigError("--resume", "is given with a sweep config or overrides", "a resumed sweep keeps its "
                          "own config; drop the config and the overrides")
    # Checked before the driver (torch) and Ray Tune are imported (~5 CPU-s), which a mistyped field need not wait for.
    spec = None if resume else _parsed_sweep(config, sets)
    from raydl.driver.ray_trainer import cluster_address
    from raydl.tune.sweep import resume_sweep, run_sweep

    address = cluster_address(address)
    if resume:
        return resume_sweep(resume, address=address, model=model)
    if config is None and _has_gpu(address):
        spec = _parsed_sweep(None, sets, gpu=True)
    return run_sweep(spec, address=address, model=model)


def _parsed_sweep(config: str | Path | Mapping[str, Any] | None, sets: list[str], *, gpu: bool = False):
    """The sweep of a file, a mapping or (None) the built-in one for CPUs or GPUs, with the base's overrides applied."""
    from raydl.tune.space import default_sweep, parse_sweep

    if config is None:
        return parse_sweep(default_sweep(gpu=gpu), overrides=sets)   # bad overrides fail before Ray starts
    is_file = isinstance(config, (str, Path))
    tree = read_yaml(config) if is_file else copy.deepcopy(dict(config))
    return parse_sweep(tree, base_dir=Path(config).parent if is_file else Path("."), overrides=sets)


def _config_tree(config: str | Path | Mapping[str, Any] | JobConfig | None) -> dict[str, Any]:
    if config is None:
        return {}
    if isinstance(config, (str, Path)):
        return read_yaml(config)
    if isinstance(config, JobConfig):
        return config.to_dict()
    if isinstance(config, Mapping):
        return copy.deepcopy(dict(config))
    raise ConfigError("config", f"is a {type(config).__name__}", "pass a YAML file path, a dict of sections "
                      "({'train': {'lr': 0.001}}) or a raydl JobConfig")


def _listed(overrides: Overrides) -> list[str] | dict[str, Any]:
    if isinstance(overrides, str):
        raise ConfigError("overrides", f"is the string {overrides!r}", f"pass a list: overrides=[{overrides!r}]")
    return dict(overrides) if isinstance(overrides, Mapping) else list(overrides)


def _model_name(model: ModelSpec | None) -> dict[str, Any]:
    """The config records the spec object's name, so config.yaml says which model ran."""
    if model is None:
        return {}
    if not isinstance(model, ModelSpec):
        raise ConfigError("model", f"is a {type(model).__name__}, not a raydl.ModelSpec",
                          "pass raydl.ModelSpec(...), or None to use model.name")
    return {"model.name": model.name}


def _as_strings(overrides: list[str] | dict[str, Any]) -> list[str]:
    """Sweep overrides travel as `path=value` text (they are written to sweep.yaml)."""
    return [f"{path}={value}" for path, value in overrides.items()] if isinstance(overrides, dict) else overrides


def _has_gpu(address: str | None) -> bool:
    """fp16 joins the default sweep only where there are GPUs (CPU autocast fp16 is slow and unscaled)."""
    if address:
        import ray

        from raydl.driver.ray_trainer import connect, ray_env

        connect(address, ray_env(JobConfig()))
        return ray.cluster_resources().get("GPU", 0) > 0
    import torch

    return torch.cuda.is_available()
