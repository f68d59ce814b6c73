"""raydl config show: print the effective config (file + overrides + defaults) as YAML."""

from __future__ import annotations

from raydl.cli.common import add_config_args, config_from_args, parser_kwargs
from raydl.overrides import dump_yaml


def register(sub) -> None:
    p = sub.add_parser("config", help="Show the effective config.")
    csub = p.add_subparsers(dest="action", required=True)
    show = csub.add_parser("show", **parser_kwargs("Print the effective config as YAML."))
    add_config_args(show)
    show.set_defaults(func=run_show)


def run_show(args) -> int:
    print(dump_yaml(config_from_args(args)), end="")
    return 0
