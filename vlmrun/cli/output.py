"""What the commands print: one JSON object for scripts (`--json`), or a table of `vlmrun.observe.tables`;
and the options every command spells the same (`--json`, `--set`).

While a `--json` command runs, stdout is the JSON document's alone (`json_stdout`): descriptor 1 points
at stderr, so whatever else prints there (a library, a user's reward module, a process it starts) lands
on stderr, and `print_json` writes to the real stdout.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
from collections.abc import Iterator

import typer

JsonOpt = typer.Option(False, "--json", help="print one JSON object for scripts instead of text")
SetOpt = typer.Option(None, "--set", help="override a recipe field, e.g. --set train.max_steps=400 (repeatable)")

_JSON_OUT: list = []  # the real stdout while a --json command runs


@contextlib.contextmanager
def json_stdout() -> Iterator[None]:
    """For the length of a `--json` command: descriptor 1 (and so sys.stdout) is stderr; `print_json`
    writes to the stdout the command was given."""
    sys.stdout.flush()
    real = os.fdopen(os.dup(1), "w", encoding="utf-8")
    os.dup2(2, 1)
    _JSON_OUT.append(real)
    try:
        yield
    finally:
        _JSON_OUT.pop()
        with contextlib.suppress(OSError, ValueError):
            sys.stdout.flush()
        real.flush()
        os.dup2(real.fileno(), 1)
        real.close()


def print_json(obj) -> None:
    """`obj` as the command's one JSON document, on the real stdout (see `json_stdout`)."""
    typer.echo(json.dumps(obj, indent=2, sort_keys=False, default=str), file=_JSON_OUT[-1] if _JSON_OUT else None)


def print_result(result: dict, json_out: bool, table: str) -> None:
    """`result` as one JSON object with --json, else as the table `vlmrun.observe.tables.<table>` prints."""
    if json_out:
        print_json(result)
    else:
        from vlmrun.observe import tables

        getattr(tables, table)(result)
