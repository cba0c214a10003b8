"""What the commands print: one JSON object for scripts (`--json`), or a table of `vlmrun.observe.tables`;
and the options every command spells the same (`--json`, `--set`)."""

from __future__ import annotations

import json

import typer

JsonOpt = typer.Option(False, "--json", help="print one JSON object for scripts instead of text")
SetOpt = typer.Option(None, "--set", help="override a recipe field, e.g. --set train.max_steps=400 (repeatable)")


def print_json(obj) -> None:
    typer.echo(json.dumps(obj, indent=2, sort_keys=False, default=str))


def print_result(result: dict, json_out: bool, table: str) -> None:
    """`result` as one JSON object with --json, else as the table `vlmrun.observe.tables.<table>` prints."""
    if json_out:
        print_json(result)
    else:
        from vlmrun.observe import tables

        getattr(tables, table)(result)
