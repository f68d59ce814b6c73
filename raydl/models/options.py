"""`model.options` -> the object a spec's `build` receives, as strict as raydl's own config.

When `ModelSpec.options` is a dataclass, each key of `model.options` must be one of its fields and
is converted to the field's type (`--set model.options.layers=4` gives an int); an unknown key or
a wrong type is a ConfigError naming `model.options.KEY`. Without one, the mapping goes to `build`
as it is. `model.size` and `model.dropout` fill the options fields of those names, so a preset and
the dropout are set in one place whatever the model. An options class with a `resolve_names(given) -> given`
classmethod turns the names users write into its fields first (HfOptions: aliases, transformers' names).
"""

from __future__ import annotations

import dataclasses
import typing
from typing import Any

from raydl.config import ModelSection
from raydl.errors import ConfigError, RaydlError
from raydl.models.spec import ModelSpec
from raydl.overrides import coerce

SHARED = ("size", "dropout")   # model.<name> fields that reach the options field of the same name


def build_options(spec: ModelSpec, section: ModelSection) -> Any:
    given = dict(section.options)
    if spec.options is None:
        _refuse_unused_shared(spec, section, takes=())
        return given
    resolve_names = getattr(spec.options, "resolve_names", None)
    if resolve_names:   # an options class that takes other names for its fields (hf: transformers' and raydl's)
        given = resolve_names(given)
    fields = {f.name: f for f in dataclasses.fields(spec.options) if f.init}
    hints = typing.get_type_hints(spec.options)
    values = {key: _option_value(spec, fields, hints, key, value) for key, value in given.items()}
    _refuse_unused_shared(spec, section, takes=fields)
    values.update({name: getattr(section, name) for name in SHARED if name in fields})
    required = [name for name, f in fields.items() if name not in values
                and f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING]
    if required:
        raise ConfigError(f"model.options.{required[0]}", f"is required by model '{spec.name}'",
                          f"set it, e.g. --set model.options.{required[0]}=VALUE")
    try:
        return spec.options(**values)
    except RaydlError:
        raise
    except Exception as e:   # the options' own __post_init__ checks
        raise ConfigError("model.options", f"{values} were refused by {spec.options.__name__}: "
                          f"{type(e).__name__}: {e}", "give values it accepts") from None


def _option_value(spec: ModelSpec, fields: dict[str, dataclasses.Field], hints: dict[str, Any], key: str,
                  value: Any) -> Any:
    if key in SHARED and key in fields:
        raise ConfigError(f"model.options.{key}", f"is set through model.{key}", f"use --set model.{key}={value}")
    if key not in fields:
        raise ConfigError(f"model.options.{key}", f"is not an option of model '{spec.name}'",
                          f"its options are {', '.join(fields) or 'none'} (`raydl train --help` lists the built-in "
                          f"models' options)")
    return coerce(f"model.options.{key}", value, hints[key])


def _refuse_unused_shared(spec: ModelSpec, section: ModelSection, *, takes) -> None:
    defaults = {f.name: f.default for f in dataclasses.fields(ModelSection)}
    for name in SHARED:
        value = getattr(section, name)
        if name not in takes and value != defaults[name]:
            raise ConfigError(f"model.{name}", f"is {value!r}, but model '{spec.name}' has no {name} option",
                              f"leave model.{name} at its default ({defaults[name]!r})")
