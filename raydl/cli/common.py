"""Arguments shared by the commands that take a training config."""

from __future__ import annotations

import argparse
import dataclasses
import textwrap

from raydl.config import iter_fields
from raydl.models.options import SHARED
from raydl.models.presets import BUILTIN_OPTIONS
from raydl.overrides import load_config


def fields_help() -> str:
    lines, current = ["config fields (--set section.key=value; YAML: section: {key: value}):"], None
    for section, f in iter_fields():
        if section != current:
            lines.append(f"\n  {section}:")
            current = section
        lines.extend(_field_line(f"{section}.{f.name}", f))
    lines.append("")
    lines.extend(textwrap.wrap("model.options of the built-in models (--set model.options.KEY=VALUE; YAML: model: "
                               f"{{options: {{KEY: VALUE}}}}; model.{' and model.'.join(SHARED)} set their "
                               f"{' and '.join(SHARED)}):", 110))
    for model, options in BUILTIN_OPTIONS.items():
        lines.append(f"\n  {model}:")
        for f in dataclasses.fields(options):
            if f.name not in SHARED:
                lines.extend(_field_line(f"model.options.{f.name}", f))
    return "\n".join(lines)


def _field_line(path: str, f: dataclasses.Field) -> list[str]:
    default = f.default if f.default_factory is dataclasses.MISSING else f.default_factory()
    return textwrap.wrap(f"{path} = {default!r}  {f.metadata['help']}", 110, initial_indent="    ",
                         subsequent_indent="        ")


def add_config_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", help="YAML config file (sections as below).")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE",
                   help="Override one config field; repeatable; strict (unknown key or wrong type is an error).")


def config_from_args(args: argparse.Namespace):
    return load_config(args.config, args.overrides)


def parser_kwargs(help: str) -> dict:
    return {"help": help, "description": help, "epilog": fields_help(),
            "formatter_class": argparse.RawDescriptionHelpFormatter}
