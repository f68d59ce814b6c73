"""What a sweep is, as data: a base training config, a search space over dotted config keys, an objective.

    # sweep.yaml                                    (raydl sweep --config sweep.yaml)
    base: {train: {max_steps: 100}}                 # a training config tree; or base_config: train.yaml
    space:
      train.global_batch_size: [64, 128, 256]       # a list is a grid: every value is tried
      train.precision: choice([fp32, bf16])         # random pick per sample
      train.lr: loguniform(1e-4, 3e-3)              # uniform(a, b), loguniform(a, b), randint(a, b) (b excluded)
      model.options.layers: [2, 4]                  # an entry of the model's options (checked against them)
    lr_scaling: sqrt                                # none | linear | sqrt with global batch vs the base's
    objective: time_to_target                       # eval_loss | samples_per_s | time_to_target | cost_to_target
    target_loss: 1.6

Everything here is pure and checked before Ray starts: a bad key, a wrong-typed value, an
empty space or an objective that cannot be computed is a ConfigError (exit code 2). A trial's
config is `apply_overrides(base, trial) -> build_config`, the same path as `--set` on `raydl train`.
A `model.options.<field>` key's values are typed and checked by the model's own options, which only the
model knows: `raydl.tune.sweep.prepare_data` builds every probed trial's options, still before Ray starts.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from raydl.config import JobConfig, field_type, iter_fields
from raydl.errors import ConfigError
from raydl.overrides import apply_overrides, build_config, coerce, read_yaml

# objective -> (metric key in the trial results, Tune mode)
OBJECTIVES = {"eval_loss": ("eval_loss", "min"), "samples_per_s": ("samples_per_s", "max"),
              "time_to_target": ("time_to_target_s", "min"), "cost_to_target": ("cost_to_target_usd", "min")}
TARGET_OBJECTIVES = ("time_to_target", "cost_to_target")   # the objectives that need target_loss
LR_SCALINGS = ("none", "linear", "sqrt")
TARGET_METRICS = ("train_loss", "eval_loss")
DISTRIBUTIONS = ("choice", "uniform", "loguniform", "randint")
_CALL = re.compile(r"^\s*([A-Za-z_]\w*)\s*\((.*)\)\s*$", re.S)
# The sweep directory is runs_dir/<name>-<time>: a name with '/' or '..' would put it anywhere.
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")
# A grid larger than this is almost surely a typo (and would take days on one machine).
MAX_GRID = 1000


@dataclass(frozen=True)
class Dim:
    """One searched config key: kind 'grid' | 'choice' (values) or 'uniform' | 'loguniform' | 'randint' (low, high)."""

    path: str
    kind: str
    values: tuple = ()
    low: float = 0.0
    high: float = 0.0

    def tune_domain(self):
        from ray import tune

        if self.kind == "grid":
            return tune.grid_search(list(self.values))
        if self.kind == "choice":
            return tune.choice(list(self.values))
        return getattr(tune, self.kind)(self.low, self.high)

    def probe_values(self) -> tuple:
        """Values that stand for this dimension when trial configs are checked up front."""
        if self.kind in ("grid", "choice"):
            return self.values
        return (self.low, self.high - 1) if self.kind == "randint" else (self.low, self.high)


@dataclass(kw_only=True)
class AshaSpec:
    grace_samples: int | None = None   # None = an eighth of the sample budget
    reduction_factor: int = 2

    def grace(self, budget: int) -> int:
        return self.grace_samples or max(1, budget // 8)


@dataclass(kw_only=True)
class SweepSpec:
    name: str = "sweep"
    base: dict[str, Any] = field(default_factory=dict)
    space: dict[str, Dim] = field(default_factory=dict)
    num_samples: int = 1
    lr_scaling: str = "none"
    objective: str = "time_to_target"
    target_loss: float | None = None
    target_metric: str = "train_loss"
    sample_budget: int = 0           # 0 = base train.max_steps * base train.global_batch_size
    micro_batch: str = "per_worker"  # per_worker: micro = global / workers (no accumulation); config: keep it
    max_concurrent_trials: int = 0   # 0 = as many as the cluster's CPUs (and GPUs) fit
    asha: AshaSpec | None = None

    @property
    def metric(self) -> tuple[str, str]:
        return OBJECTIVES[self.objective]

    def base_config(self) -> JobConfig:
        return build_config(self.base)

    def budget(self) -> int:
        base = self.base_config().train
        return self.sample_budget or base.max_steps * base.global_batch_size

    def to_dict(self) -> dict[str, Any]:
        """The YAML shape `parse_sweep` reads: the sweep directory keeps it for --resume."""
        out = {k: getattr(self, k) for k in ("name", "base", "num_samples", "lr_scaling", "objective",
                                               "target_loss", "target_metric", "sample_budget", "micro_batch",
                                               "max_concurrent_trials")}
        out["space"] = {d.path: _dim_to_yaml(d) for d in self.space.values()}
        out["asha"] = dataclasses.asdict(self.asha) if self.asha else None
        return out


def _dim_to_yaml(d: Dim) -> Any:
    if d.kind == "grid":
        return list(d.values)
    if d.kind == "choice":
        return f"choice({yaml.safe_dump(list(d.values), default_flow_style=True).strip()})"
    return f"{d.kind}({d.low!r}, {d.high!r})"


def _field(path: str):
    """(type, choices) of a config field; (None, None) for an entry of a mapping field (model.options.layers),
    whose owner types and checks it."""
    section, _, key = path.partition(".")
    apply_overrides({}, {path: None})            # unknown section/key -> ConfigError with a suggestion
    if key.count("."):
        return None, None
    tp = field_type(section, key)
    choices = next(f.metadata.get("choices") for s, f in iter_fields() if s == section and f.name == key)
    return tp, choices


def _checked(path: str, value: Any, tp, choices) -> Any:
    if tp is None:
        return value
    value = coerce(f"space.{path}", value, tp)
    if choices and value not in choices:
        raise ConfigError(f"space.{path}", f"has {value!r}, not one of {', '.join(choices)}",
                          f"use only {', '.join(choices)}")
    return value


def parse_dim(path: str, raw: Any) -> Dim:
    """One `space:` entry -> Dim; every value is converted to the field's type now, not in a trial."""
    if not isinstance(path, str) or path.count(".") not in (1, 2):
        raise ConfigError(f"space.{path}", "is not a dotted config key", "write keys as section.key, e.g. train.lr, "
                          "or section.key.entry for an entry of a mapping, e.g. model.options.layers")
    tp, choices = _field(path)
    if isinstance(raw, list):
        if not raw:
            raise ConfigError(f"space.{path}", "is an empty list", "give at least one value, e.g. [64, 128]")
        return Dim(path, "grid", tuple(_checked(path, v, tp, choices) for v in raw))
    call = _CALL.match(raw) if isinstance(raw, str) else None
    if call is None:    # a plain value: the same in every trial
        return Dim(path, "grid", (_checked(path, raw, tp, choices),))
    kind, args_text = call.groups()
    if kind not in DISTRIBUTIONS:
        raise ConfigError(f"space.{path}", f"uses '{kind}(...)', which is not a distribution",
                          f"use a list (grid) or one of {', '.join(d + '(...)' for d in DISTRIBUTIONS)}")
    try:
        args = yaml.safe_load(f"[{args_text}]")
    except yaml.YAMLError:
        args = None
    if kind == "choice":
        values = args[0] if args and len(args) == 1 and isinstance(args[0], list) else None
        if not values:
            raise ConfigError(f"space.{path}", f"has {raw!r}", "write choice([a, b, ...]) with at least one value")
        return Dim(path, "choice", tuple(_checked(path, v, tp, choices) for v in values))
    return _range_dim(path, kind, raw, args, tp)


def _range_dim(path: str, kind: str, raw: str, args, tp) -> Dim:
    want = int if kind == "randint" else float
    if tp is not None and tp is not want:
        raise ConfigError(f"space.{path}", f"is a field of type {getattr(tp, '__name__', tp)}, so {kind}(...) "
                          f"does not fit it", "use randint(a, b) for integers, uniform/loguniform(a, b) for floats, "
                          "a list or choice([...]) for anything")
    nums = [coerce(f"space.{path}", a, want) for a in args] if isinstance(args, list) and len(args) == 2 else None
    if (nums is None or not all(map(math.isfinite, nums)) or not nums[0] < nums[1]
            or (kind == "loguniform" and nums[0] <= 0)):
        need = "finite 0 < a < b" if kind == "loguniform" else "finite a < b"
        raise ConfigError(f"space.{path}", f"has {raw!r}", f"write {kind}(a, b) with {need}")
    return Dim(path, kind, low=nums[0], high=nums[1])


_SPEC_KEYS = {f.name for f in dataclasses.fields(SweepSpec)} | {"base_config"}


def parse_sweep(data: dict[str, Any], *, base_dir: Path = Path("."), overrides: list[str] = ()) -> SweepSpec:
    """Sweep YAML tree -> SweepSpec, fully checked (see `check_sweep`). `overrides` apply to the base config."""
    if not isinstance(data, dict):
        raise ConfigError("<sweep>", f"must be a mapping, got {type(data).__name__}", "see `raydl sweep --help`")
    for key in data:
        if key not in _SPEC_KEYS:
            raise ConfigError(key, "is not a sweep setting (did you mean to put it under 'base:' or 'space:'?)",
                              f"use one of {', '.join(sorted(_SPEC_KEYS))}")
    base = data.get("base") or {}
    if data.get("base_config"):
        if base:
            raise ConfigError("base_config", "is given together with 'base'", "use one of them")
        base = read_yaml(base_dir / data["base_config"])
    base = apply_overrides(base, list(overrides))
    space = data.get("space") or {}
    if not isinstance(space, dict) or not space:
        raise ConfigError("space", "is empty" if not space else f"is a {type(space).__name__}, not a mapping",
                          "give at least one key to search, e.g. space: {train.global_batch_size: [64, 128]}")
    asha = data.get("asha")
    spec = SweepSpec(
        name=str(data.get("name", "sweep")), base=base, space={p: parse_dim(p, v) for p, v in space.items()},
        num_samples=_typed(data, "num_samples", int, 1), lr_scaling=_typed(data, "lr_scaling", str, "none"),
        objective=_typed(data, "objective", str, "time_to_target"),
        target_loss=_typed(data, "target_loss", float, None), target_metric=_typed(data, "target_metric", str, "train_loss"),
        sample_budget=_typed(data, "sample_budget", int, 0), micro_batch=_typed(data, "micro_batch", str, "per_worker"),
        max_concurrent_trials=_typed(data, "max_concurrent_trials", int, 0),
        asha=None if asha in (None, False) else _asha(asha))
    check_sweep(spec)
    return spec


def _typed(data: dict, key: str, tp, default):
    value = data.get(key)
    return default if value is None else coerce(key, value, tp)


def _asha(raw: Any) -> AshaSpec:
    if raw is True:
        return AshaSpec()
    if not isinstance(raw, dict) or set(raw) - {"grace_samples", "reduction_factor"}:
        raise ConfigError("asha", f"is {raw!r}", "write asha: true, or asha: {grace_samples: N, reduction_factor: 2}")
    return AshaSpec(**{k: coerce(f"asha.{k}", v, int) for k, v in raw.items() if v is not None})


def _one_of(key: str, value: str, options) -> None:
    if value not in options:
        raise ConfigError(key, f"is {value!r}, not one of {', '.join(options)}", f"set {key}: {options[0]}")


def check_sweep(spec: SweepSpec) -> None:
    """Everything checkable before a trial starts; every grid point's config must build."""
    if not _NAME.fullmatch(spec.name):
        raise ConfigError("name", f"is {spec.name!r}, which cannot name the sweep directory",
                          "use letters, digits, '.', '_' and '-' only (at most 64), starting with a letter or digit")
    _one_of("objective", spec.objective, tuple(OBJECTIVES))
    _one_of("lr_scaling", spec.lr_scaling, LR_SCALINGS)
    _one_of("target_metric", spec.target_metric, TARGET_METRICS)
    _one_of("micro_batch", spec.micro_batch, ("per_worker", "config"))
    _check_target(spec)
    base = spec.base_config()
    if spec.target_metric == "eval_loss" and not base.train.eval_every:
        raise ConfigError("target_metric", "is eval_loss but base train.eval_every is 0 (evaluation only at the end)",
                          "set base train.eval_every: N, or target_metric: train_loss")
    if spec.sample_budget and "train.max_steps" in spec.space:
        raise ConfigError("sample_budget", "and a searched train.max_steps both set the length of a trial",
                          "keep only one of them")
    for key, least in (("num_samples", 1), ("sample_budget", 0), ("max_concurrent_trials", 0)):
        if getattr(spec, key) < least:
            raise ConfigError(key, f"is {getattr(spec, key)}", f"use a whole number >= {least}")
    if spec.asha:
        _check_asha(spec.asha, spec.budget())
    for params in probe_points(spec):
        trial_config(spec, params, where=f"trial {params}")


def _check_target(spec: SweepSpec) -> None:
    if spec.objective in TARGET_OBJECTIVES and spec.target_loss is None:
        raise ConfigError("target_loss", f"is missing; the {spec.objective} objective needs it",
                          "set target_loss: <loss to reach>, or pick objective: eval_loss or samples_per_s")
    if spec.objective not in TARGET_OBJECTIVES and spec.target_loss is not None:
        raise ConfigError("target_loss", f"is set but the objective is {spec.objective}, which ignores it",
                          "remove target_loss, or set objective: time_to_target or cost_to_target")
    if spec.target_loss is not None and not math.isfinite(spec.target_loss):
        raise ConfigError("target_loss", f"is {spec.target_loss}, which no loss ever reaches",
                          "set a finite loss, e.g. target_loss: 1.8")


def _check_asha(asha: AshaSpec, budget: int) -> None:
    """What Ray's ASHAScheduler asserts (async_hyperband.py), said before Ray starts."""
    if asha.reduction_factor < 2:
        raise ConfigError("asha.reduction_factor", f"is {asha.reduction_factor}; ASHA keeps 1/reduction_factor of "
                          "the trials at each rung, so it must be >= 2", "use 2 (halving) or 3")
    if budget < 2:
        raise ConfigError("asha", f"is set but each trial sees only {budget} sample", "drop asha or give trials "
                          "more samples (sample_budget, or base train.max_steps x train.global_batch_size)")
    # The scheduler's last rung is below the budget (tune/sweep.py::_asha), so the first one must be too.
    if asha.grace_samples is not None and not 1 <= asha.grace_samples < budget:
        raise ConfigError("asha.grace_samples", f"is {asha.grace_samples}, outside 1..{budget - 1} (a trial sees "
                          f"{budget} samples)", f"use a number of samples between 1 and {budget - 1}, or leave it "
                          f"out (default {AshaSpec().grace(budget)}, an eighth of the budget)")


def probe_points(spec: SweepSpec):
    dims = list(spec.space.values())
    points = list(itertools.product(*(d.probe_values() for d in dims)))
    if len(points) > MAX_GRID:
        raise ConfigError("space", f"has {len(points)} grid points", f"search at most {MAX_GRID}; use choice/ranges "
                          "with num_samples for large spaces")
    return [{d.path: v for d, v in zip(dims, p)} for p in points]


def trial_tree(spec: SweepSpec, params: dict[str, Any]) -> dict[str, Any]:
    """The training config tree of one trial: base + trial values + the sweep's rules (lr scaling, budget, micro)."""
    base = spec.base_config()
    tree = apply_overrides(spec.base, params)
    cfg = build_config(tree)
    t, s = cfg.train, cfg.scaling
    extra: dict[str, Any] = {}
    ratio = t.global_batch_size / base.train.global_batch_size
    if spec.lr_scaling != "none":
        extra["train.lr"] = t.lr * (ratio if spec.lr_scaling == "linear" else math.sqrt(ratio))
    if "train.max_steps" not in params:
        extra["train.max_steps"] = math.ceil(spec.budget() / t.global_batch_size)
    # A batch-size sweep should measure batch size, not gradient accumulation: one micro-batch per worker.
    if (spec.micro_batch == "per_worker" and "train.micro_batch_size" not in params and cfg.parallel.pp_degree == 1
            and s.min_workers == s.max_workers and t.global_batch_size % s.max_workers == 0):
        extra["train.micro_batch_size"] = t.global_batch_size // s.max_workers
    return apply_overrides(tree, extra)


def trial_config(spec: SweepSpec, params: dict[str, Any], *, where: str = "trial") -> JobConfig:
    with trial_errors(where):
        return build_config(trial_tree(spec, params))


@contextlib.contextmanager
def trial_errors(where: str):
    """A ConfigError about one trial's config says which trial, and that the space or the base is to change."""
    try:
        yield
    except ConfigError as e:
        raise ConfigError(e.path, f"is invalid in {where}: {e.path} {e.problem}",
                          f"{e.fix}; or change the space or the base config") from None


def trains_in_trial(cfg: JobConfig) -> bool:
    """A 1-worker trial trains in its Tune trial's own process (raydl.tune.trial_session): a Train controller and
    worker group would add their start to every trial. Larger trials go through Ray Train."""
    return cfg.scaling.max_workers == 1


def trial_resources(cfg: JobConfig, use_gpu: bool) -> dict[str, float]:
    """What a trial's Tune actor holds: its worker's CPUs and GPUs when it trains there, else 1 CPU for the
    Train driver it runs (the Train workers hold their own)."""
    s = cfg.scaling
    if not trains_in_trial(cfg):
        return {"CPU": 1.0}
    return {"CPU": s.cpus_per_worker, **({"GPU": s.gpus_per_worker} if use_gpu and s.gpus_per_worker else {})}


def trial_cpus_gpus(spec: SweepSpec, use_gpu: bool) -> tuple[float, float]:
    """Most CPUs and GPUs one trial holds: its Tune actor's (trial_resources) + its Train workers' if any."""
    cpus, gpus = 0.0, 0.0
    for params in probe_points(spec):
        cfg = trial_config(spec, params)
        own, s = trial_resources(cfg, use_gpu), cfg.scaling
        workers = 0 if trains_in_trial(cfg) else s.max_workers
        cpus = max(cpus, own["CPU"] + workers * s.cpus_per_worker)
        gpus = max(gpus, own.get("GPU", 0.0) + (workers * s.gpus_per_worker if use_gpu else 0.0))
    return cpus, gpus


def default_sweep(*, gpu: bool) -> dict[str, Any]:
    """What `raydl sweep` runs with no --config (jobs/configs/sweep-default.yaml is the same sweep, as a file)."""
    return {
        "name": "sweep",
        "base": {"scaling": {"min_workers": 1, "max_workers": 1},
                 "train": {"max_steps": 100, "warmup_steps": 10},
                 "telemetry": {"report_every": 10, "progress": False},
                 "checkpoint": {"every_steps": 50}},
        "space": {"train.global_batch_size": [32, 64, 128, 256],
                  "train.precision": ["fp32", "bf16", "fp16"] if gpu else ["fp32", "bf16"]},
        "lr_scaling": "sqrt",
        "objective": "time_to_target",
        "target_loss": 1.8,
    }


__all__ = ["Dim", "SweepSpec", "AshaSpec", "OBJECTIVES", "parse_sweep", "parse_dim", "check_sweep", "trial_tree",
           "trial_config", "trial_cpus_gpus", "trial_resources", "trains_in_trial", "default_sweep", "probe_points"]
