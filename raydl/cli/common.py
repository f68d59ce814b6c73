"""Arguments shared by the commands that take a training config."""

from __future__ import annotations

import argparse
import textwrap

from raydl.config import iter_fields
from raydl.overrides import load_config


def fields_help() -> str:
    lines, current = ["config fields (--set section.key=value; YAML: section: {key: value}):"], None
    for section, f in iter_fields():
        if section != current:
            lines.append(f"\n  {section}:")
            current = section
        default = f.default if f.default_factory is __import__("dataclasses").MISSING else f.default_factory()
        text = f"{section}.{f.name} = {default!r}  {f.metadata['help']}"
        lines.extend(textwrap.wrap(text, 110, initial_indent="    ", subsequent_indent="        "))
    return "\n".join(lines)


def add_config_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", help="YAML config file (sections as below).")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE",
                   help="Override one config field; repeatable; strict (unknown key or wrong type is an error).")


def config_from_args(args: argparse.Namespace):
    return load_config(args.config, args.overrides)


def parser_kwargs(help: str) -> dict:
    return {"help": help, "description": help, "epilog": fields_help(),
            "formatter_class": argparse.RawDescriptionHelpFormatter}
