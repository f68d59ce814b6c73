"""Strict config loading: YAML file + `section.key=value` overrides -> JobConfig.

Strict as in nanoGPT's configurator, without `exec`: an unknown section or key is an
error, and every value must convert to the field's declared type. The CLI, the job
entry points and Ray Tune trials all go through `load_config` / `apply_overrides`.
"""

from __future__ import annotations

import copy
import difflib
import typing
from pathlib import Path
from typing import Any

import yaml

from raydl.config import SECTIONS, JobConfig, field_type, is_union
from raydl.errors import ConfigError


def _suggest(word: Any, options) -> str:
    close = difflib.get_close_matches(str(word), list(options), n=1)
    return f"did you mean '{close[0]}'? " if close else ""


def _check_key(section: str, key: str | None = None) -> None:
    if section not in SECTIONS:
        raise ConfigError(section, "is not a config section",
                          f"{_suggest(section, SECTIONS)}sections are {', '.join(SECTIONS)}")
    if key is not None:
        keys = typing.get_type_hints(SECTIONS[section])
        if key not in keys:
            raise ConfigError(f"{section}.{key}", "is not a config field",
                              f"{_suggest(key, keys)}see `raydl train --help` for the fields of '{section}'")


def coerce(path: str, value: Any, tp: Any) -> Any:
    """Convert `value` (from YAML or a CLI string) to `tp`, or raise ConfigError."""
    if is_union(tp):
        for option in typing.get_args(tp):
            try:
                return coerce(path, value, option)
            except ConfigError:
                continue
        raise ConfigError(path, f"got {value!r}", f"give a value of type {tp}")
    if typing.get_origin(tp) is list:
        (item_tp,) = typing.get_args(tp)
        if isinstance(value, str):
            value = _safe_yaml(path, value) if value.strip() else []
            value = value if isinstance(value, list) else [value]
        if not isinstance(value, (list, tuple)):
            raise ConfigError(path, f"got {value!r}, expected a list", "write it as [1, 2]")
        return [coerce(path, v, item_tp) for v in value]
    if typing.get_origin(tp) is dict:   # a mapping (model.options): whoever reads it checks its values
        if isinstance(value, str):
            value = _safe_yaml(path, value) if value.strip() else {}
        if not isinstance(value, dict) or not all(isinstance(k, str) for k in value):
            raise ConfigError(path, f"got {value!r}, expected a mapping", f"write it as {{key: value}} in YAML, or "
                              f"--set {path}.KEY=VALUE")
        return dict(value)
    if isinstance(value, str) and tp is not str:
        value = _parse_scalar(path, value, tp)
    if tp is bool and isinstance(value, bool):
        return value
    if tp is int and isinstance(value, int) and not isinstance(value, bool):
        return value
    if tp is float and isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    if tp is float and isinstance(value, str):   # '3e-3' from a YAML file
        try:
            return float(value)
        except ValueError:
            pass
    if tp is str and isinstance(value, bool):     # `use_gpu: false` in YAML
        return "true" if value else "false"
    if tp is str and isinstance(value, (str, int, float)):
        return str(value)
    raise ConfigError(path, f"must be of type {getattr(tp, '__name__', tp)}, got {value!r}",
                      f"give a {getattr(tp, '__name__', tp)} value, e.g. --set {path}=<value>")


def _parse_scalar(path: str, text: str, tp: Any) -> Any:
    """CLI text -> Python value. Numbers are parsed directly: YAML 1.1 reads '3e-3' as a string."""
    if tp in (int, float):
        try:
            return tp(text)
        except ValueError:
            pass
    return _safe_yaml(path, text) if text.strip() else text


def _safe_yaml(path: str, text: str) -> Any:
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as e:
        raise ConfigError(path, f"has the value {text!r}, which is not valid YAML ({str(e).splitlines()[0]})",
                          "quote the value or fix its brackets, e.g. --set parallel.stage_cuts=[2,4]") from None


def build_config(tree: dict[str, Any]) -> JobConfig:
    """Nested dict (YAML shape) -> validated JobConfig; unknown keys are errors."""
    if not isinstance(tree, dict):
        raise ConfigError("<root>", f"must be a mapping of sections, got {type(tree).__name__}",
                          "write the config as 'section:' blocks of 'key: value'")
    sections = {}
    for section, values in tree.items():
        _check_key(section)
        if values is None:
            values = {}
        if not isinstance(values, dict):
            raise ConfigError(section, f"must be a mapping, got {values!r}", f"write '{section}:' then indented keys")
        kwargs = {}
        for key, value in values.items():
            _check_key(section, key)
            kwargs[key] = coerce(f"{section}.{key}", value, field_type(section, key))
        sections[section] = SECTIONS[section](**kwargs)
    return JobConfig(**sections)


def parse_assignment(text: str) -> tuple[str, str, str]:
    if "=" not in text or "." not in text.split("=", 1)[0]:
        raise ConfigError(text, "is not of the form section.key=value", "write e.g. --set train.lr=0.001")
    path, value = text.split("=", 1)
    section, key = path.strip().split(".", 1)
    _check_key(section, key.split(".", 1)[0])
    return section, key, value


def apply_overrides(tree: dict[str, Any], assignments: dict[str, Any] | list[str]) -> dict[str, Any]:
    """Return a copy of `tree` with dotted overrides applied (CLI strings or Tune values)."""
    tree = copy.deepcopy(tree)
    items = (assignments.items() if isinstance(assignments, dict)
             else [(f"{s}.{k}", v) for s, k, v in map(parse_assignment, assignments)])
    for path, value in items:
        section, _, key = path.partition(".")
        key, _, entry = key.partition(".")
        _check_key(section, key)
        tree.setdefault(section, {})
        if tree[section] is None:
            tree[section] = {}
        if entry:
            _set_entry(tree[section], path, key, entry, value, from_cli=not isinstance(assignments, dict))
        else:
            tree[section][key] = value
    return tree


def _set_entry(values: dict[str, Any], path: str, key: str, entry: str, value: Any, *, from_cli: bool) -> None:
    """`section.key.entry=value` sets one entry of a mapping field (model.options.layers=4)."""
    owner = f"{path.split('.')[0]}.{key}"
    if typing.get_origin(field_type(path.split(".")[0], key)) is not dict:
        raise ConfigError(path, f"is not a config field ({owner} has no entries)", f"write --set {owner}=VALUE")
    mapping = values.get(key)
    if mapping is None:
        mapping = values[key] = {}
    if not isinstance(mapping, dict):
        raise ConfigError(owner, f"is {mapping!r}, not a mapping, so {path} cannot be set", f"write {owner} as a "
                          "mapping {key: value}")
    # A CLI value is text: read it as YAML (4 -> int, [1, 2] -> list) for the owner's own type checks.
    mapping[entry] = _safe_yaml(path, value) if from_cli and value.strip() else value


def read_yaml(path: str | Path) -> dict[str, Any]:
    p = Path(path)
    if not p.is_file():
        raise ConfigError("--config", f"file '{p}' does not exist", "pass the path of a YAML config file")
    try:
        data = yaml.safe_load(p.read_bytes().decode("utf-8")) or {}
    except UnicodeDecodeError as e:
        raise ConfigError("--config", f"file '{p}' is not UTF-8 text (byte {e.start})",
                          "save the config as UTF-8 YAML") from None
    except yaml.YAMLError as e:
        raise ConfigError("--config", f"file '{p}' is not valid YAML ({str(e).splitlines()[0]})",
                          "fix the YAML syntax") from None
    if not isinstance(data, dict):
        raise ConfigError("--config", f"file '{p}' holds a YAML {type(data).__name__}, not a mapping of sections",
                          "write the config as 'section:' blocks of 'key: value'")
    return data


def load_config(path: str | Path | None = None, overrides: list[str] | dict[str, Any] | None = None) -> JobConfig:
    tree = read_yaml(path) if path else {}
    return build_config(apply_overrides(tree, overrides or []))


def dump_yaml(cfg: JobConfig) -> str:
    return yaml.safe_dump(cfg.to_dict(), sort_keys=False)
