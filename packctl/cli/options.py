"""Options shared by the commands: choices shown in --help, PackConfig fields as typer options
(declared once, in packctl/config.py), and the names that --help must know without importing numpy
or torch."""
from __future__ import annotations

import inspect
from typing import List, Optional

import typer

from packctl.config import FIELDS, option_help

# The names of packctl.sample.DISTRIBUTIONS and packctl.verify.backends.BACKENDS, spelled here so
# that --help and completion import neither numpy nor torch (tests/cli/test_cli.py checks they agree).
SAMPLE_DISTRIBUTIONS = ("zipf", "lognormal", "rl-longtail")
SAMPLE_GROUPS = ("none", "preference", "rollout")  # packctl.sample.GROUP_KINDS, without importing pyarrow
SAMPLE_MODALITIES = ("text", "image")  # packctl.sample.MODALITIES
VERIFY_BACKENDS = ("flash-attn", "torch-varlen", "flex", "sdpa")


def choice(values) -> dict:
    """typer.Option arguments for an option with a fixed set of values: --help shows them
    (`[input|shuffle|curriculum]`) and shell completion offers them. A value outside them is
    refused by the option's own check (one line naming the option and the choices, exit 2).
    Completion is typer's `autocompletion` (a callback taking the word typed so far):
    `--too-long tr` -> `truncate`."""
    values = tuple(values)

    def complete(incomplete: str) -> list[str]:
        return [v for v in values if v.startswith(incomplete)]

    return {"metavar": f"[{'|'.join(values)}]", "autocompletion": complete}


def config_options(names) -> list[inspect.Parameter]:
    """Typer options of PackConfig fields, made from the fields themselves (config.py `option`):
    the flag, help, choices and default are declared once, there."""
    params = []
    for name in names:
        meta = FIELDS[name].metadata
        flag = meta["flag"] or f"--{name.replace('_', '-')}"
        decls = [f"{flag}/--no-{flag[2:]}" if meta["switch"] else flag] + ([meta["short"]] if meta["short"] else [])
        declared = str(FIELDS[name].type).replace(" | None", "")
        kind = meta["cli"] or _CLI_TYPES[declared]
        if kind is list:  # a repeated flag: --keep-columns a --keep-columns b
            kind = List[str]
        choices = choice(meta["choices"]) if meta["choices"] else {}
        if meta["metavar"] or declared in _NUMBERS:
            choices["metavar"] = meta["metavar"] or _NUMBERS[declared]
        option = typer.Option(None, *decls, help=option_help(name, with_choices=not choices),
                              rich_help_panel=meta["panel"], **choices)
        params.append(inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, annotation=Optional[kind],
                                        default=option))
    return params


# Numbers are taken as typed and read by packctl (config.from_command_line), so that a value that
# is not one is refused in the words a --config file and the Python API get (`--capacity 4096.5`).
_CLI_TYPES = {"int": str, "str": str, "bool": bool, "float": str, "list[str]": list}
_NUMBERS = {"int": "N", "float": "NUMBER"}


def with_signature(params: list[inspect.Parameter]):
    """Give a `**options` function the signature typer reads its options from."""
    def decorate(fn):
        fn.__signature__ = inspect.Signature(params)
        return fn
    return decorate


JSON_OUTPUT = inspect.Parameter("json_output", inspect.Parameter.KEYWORD_ONLY, annotation=bool,
                                default=typer.Option(False, "--json", help="Print the result as JSON on stdout."))
QUIET = inspect.Parameter("quiet", inspect.Parameter.KEYWORD_ONLY, annotation=bool,
                          default=typer.Option(False, "--quiet", "-q", help="No summary table."))
