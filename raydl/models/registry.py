"""Which `ModelSpec` `model.name` names: a built-in (gpt, resnet, hf) or `package.module:attribute`.

An import path names a `raydl.ModelSpec`, or a function that returns one, in a module found
from the working directory (where Ray's local workers find it too; `raydl submit` uploads it).
Anything wrong is a ConfigError naming `model.name`: the module is not there, it fails to import,
the attribute is missing, it is not a spec, or the function raises.
"""

from __future__ import annotations

import importlib
import os
import sys
import traceback
from pathlib import Path
from typing import Any

from raydl.errors import ConfigError, RaydlError
from raydl.models.spec import ModelSpec

BUILTIN = {"gpt": "raydl.models.gpt:spec", "resnet": "raydl.models.resnet:spec", "hf": "raydl.models.hf.model:spec"}
FORM = "package.module:attribute"


def resolve_spec(name: str) -> ModelSpec:
    path = BUILTIN.get(name, name)
    module_name, _, attribute = path.partition(":")
    if not module_name or not attribute:
        raise ConfigError("model.name", f"is {name!r}, neither a built-in model ({', '.join(BUILTIN)}) nor an "
                          f"import path", f"use a built-in name, or {FORM} naming a raydl.ModelSpec (or a function "
                          f"that returns one), e.g. --set model.name=examples.mlp_classifier:spec")
    module = _import(module_name, name)
    target: Any = module
    for part in attribute.split("."):
        if not hasattr(target, part):
            raise ConfigError("model.name", f"is {name!r}, but module '{module_name}' ({module.__file__}) has no "
                              f"attribute {attribute!r}", f"define {attribute} there, or name one it has")
        target = getattr(target, part)
    return _as_spec(target, name)


def search_from(directory: str) -> None:
    """Import models from `directory` first. The driver uses its working directory (`raydl train` runs
    from a console script, whose directory, not the working one, starts sys.path); workers and Tune
    trials use the directory the driver found the module in (Ray adds the driver's working directory
    to the processes of a Ray it starts, but not to those of a Ray started elsewhere, or earlier)."""
    if directory not in sys.path and os.path.isdir(directory):
        sys.path.insert(0, directory)


def import_dir(name: str) -> str:
    """The sys.path entry an import-path model's module came from; "" for a built-in name."""
    if name in BUILTIN or ":" not in name:
        return ""
    module_name = name.partition(":")[0]
    path = Path(sys.modules[module_name].__file__)
    path = path.parent if path.name == "__init__.py" else path
    return str(path.parents[module_name.count(".")])


def _import(module_name: str, name: str):
    search_from(os.getcwd())
    try:
        return importlib.import_module(module_name)
    except RaydlError:
        raise
    except ModuleNotFoundError as e:
        if e.name and module_name.startswith(e.name) and module_name[len(e.name):][:1] in ("", "."):
            raise ConfigError("model.name", f"is {name!r}, but no module '{module_name}' is importable from the "
                              f"working directory {os.getcwd()}", f"run from the directory holding "
                              f"{module_name.replace('.', '/')}.py, or install the package that has it") from None
        raise _raised(name, f"importing '{module_name}'", e) from None
    except Exception as e:   # the user's module ran and failed: say where, in one paragraph
        raise _raised(name, f"importing '{module_name}'", e) from None


def _as_spec(target: Any, name: str) -> ModelSpec:
    if callable(target) and not isinstance(target, (ModelSpec, type)):
        try:
            target = target()
        except RaydlError:
            raise
        except Exception as e:
            raise _raised(name, f"calling {name.partition(':')[2]}()", e) from None
    if not isinstance(target, ModelSpec):
        what = f"the class {target.__name__}" if isinstance(target, type) else f"a {type(target).__name__}"
        raise ConfigError("model.name", f"is {name!r}, which is {what}, not a raydl.ModelSpec",
                          "point it at a raydl.ModelSpec(...) object, or at a function without arguments that "
                          "returns one")
    return target


def _raised(name: str, doing: str, error: Exception) -> ConfigError:
    theirs = [frame for frame in traceback.extract_tb(error.__traceback__) if frame.filename != __file__]
    at = f" at {theirs[-1].filename}:{theirs[-1].lineno}" if theirs else ""
    message = " ".join(str(error).split())[:300]
    return ConfigError("model.name", f"is {name!r}, but {doing} raised {type(error).__name__}: {message}{at}",
                       "fix that error in the model's module (or install what it imports), then run again")
