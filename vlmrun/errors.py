"""Error types shared by every layer.

`InputError` is a user mistake (a recipe field, an argument, a refused resume): the CLI prints its
message in one or two lines and exits 2, with no traceback. `CheckFailed` is a check whose answer is
"no" (a diverging comparison, a failed job): exit 1. Anything else is our bug and keeps its traceback.
"""

from __future__ import annotations

from typing import Any

EXIT_OK = 0
EXIT_CHECK_FAILED = 1
EXIT_BAD_INPUT = 2


class VlmrunError(Exception):
    """Base of the errors that the CLI turns into a short message and an exit code."""

    exit_code = EXIT_CHECK_FAILED


class InputError(VlmrunError):
    """Bad input: names the field (a dotted path or an argument), the bad value and what is allowed."""

    exit_code = EXIT_BAD_INPUT

    def __init__(self, field: str, value: Any = None, allowed: str = "", *, message: str | None = None):
        self.field, self.value, self.allowed = field, value, allowed
        if message is None:
            message = f"{field}: {_short(value)} is not allowed"
            if allowed:
                message += f"; {allowed}"
        super().__init__(message)


class CheckFailed(VlmrunError):
    """The thing checked is not so (exit 1): a comparison diverged, a job failed."""


def _short(value: Any, limit: int = 80) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."
