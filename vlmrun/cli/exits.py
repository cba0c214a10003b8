"""How the `vlmrun` command line ends: every outcome of a command as an exit code and what is said.

User mistakes print one or two lines and exit 2; a failed check exits 1; our bugs keep their
tracebacks. With `--json` (on a command that has it) every error also comes as one JSON object on
stdout, and nothing else does (whatever else prints goes to stderr while the command runs):
{"error": message, "kind": ..., "exit_code": N[, "field": ..., "value": ...]} with the same exit code
(kinds: bad_input 2, check_failed 1, internal 1 (our bug: the traceback goes to stderr), interrupted 130,
or 128 + the signal that stopped a command that writes files).
"""

from __future__ import annotations

import contextlib
import signal
import sys
import traceback

import typer

from vlmrun.cli.output import json_stdout, print_json
from vlmrun.errors import EXIT_BAD_INPUT, InputError, StopSignalled, VlmrunError, short_repr


def run(app: typer.Typer) -> None:
    """Run `app` on sys.argv and exit with the code its outcome means (module docstring). With `--json`
    the command's stdout holds its one JSON document and nothing else (cli/output.py `json_stdout`)."""
    as_json = _wants_json(app, sys.argv[1:])
    with json_stdout() if as_json else contextlib.nullcontext():
        _run(app, as_json)


def _run(app: typer.Typer, as_json: bool) -> None:
    try:
        # With standalone_mode=False click returns the code of a raised typer.Exit instead of exiting.
        code = app(standalone_mode=False)
        sys.exit(code if isinstance(code, int) else 0)
    except VlmrunError as e:
        kind = "bad_input" if e.exit_code == EXIT_BAD_INPUT else "check_failed"
        where = {"field": e.field, "value": _plain(e.value)} if isinstance(e, InputError) else {}
        _fail(str(e), e.exit_code, kind, as_json, **where)
    except StopSignalled as e:  # a signal stopped a command that writes files (cli/data.py)
        name = signal.Signals(e.signum).name
        _fail(f"stopped by {name}; what it was writing is removed", 128 + e.signum, "interrupted", as_json)
    except typer.Exit as e:
        sys.exit(e.exit_code)
    except typer.Abort:
        _fail("aborted", 130, "interrupted", as_json)
    except _click_exceptions() as e:
        ctx = getattr(e, "ctx", None)
        where = f" (see `{ctx.command_path} --help`)" if ctx is not None else ""
        code = EXIT_BAD_INPUT if e.exit_code == 2 else e.exit_code
        kind = "bad_input" if code == EXIT_BAD_INPUT else "check_failed"
        _fail(f"{e.format_message()}{where}", code, kind, as_json, **_click_field(e))
    except Exception as e:
        if not as_json:
            raise  # our bug: the traceback says where
        traceback.print_exc()
        _fail(f"internal error: {type(e).__name__}: {e}", 1, "internal", as_json)


def _fail(message: str, code: int, kind: str, as_json: bool, **where) -> None:
    """Say `message` on stderr (and as one JSON object on stdout with `--json`), exit `code`."""
    typer.echo(f"error: {message}", err=True)
    if as_json:
        print_json({"error": message, "kind": kind, "exit_code": code, **where})
    sys.exit(code)


def _click_field(e) -> dict:
    """{"field": the option or argument a click usage error is about}, or {} when it names none."""
    param = getattr(e, "param", None)
    name = getattr(e, "option_name", None) or (param.opts[0] if param is not None and param.opts else None)
    return {"field": name} if name else {}


def _plain(value):
    """`value` as JSON carries it: null, booleans and numbers as they are, anything else (a recipe value
    may be of any size or type; nan and inf are no JSON) as a string of at most 200 characters."""
    plain = value is None or (type(value) in (bool, int, float) and abs(value) < 2**53)
    return value if plain else short_repr(value, 200, quote=False)


def _wants_json(app: typer.Typer, argv: list[str]) -> bool:
    """True when `argv` names a command that has `--json` and passes it (before any `--`)."""
    from typer.main import get_command

    args = argv[: argv.index("--")] if "--" in argv else argv
    if "--json" not in args:
        return False
    command = get_command(app)
    for arg in args:
        sub = getattr(command, "commands", {}).get(arg)
        if sub is None and hasattr(command, "commands") and not arg.startswith("-"):
            return False  # no such command: not one with --json
        command = sub or command
    return any("--json" in getattr(p, "opts", ()) for p in getattr(command, "params", ()))


def _click_exceptions():
    """Typer >= 0.25 vendors click as typer._click; older ones use click itself."""
    try:
        from typer._click.exceptions import ClickException
    except ImportError:
        from click.exceptions import ClickException
    return (ClickException,)
