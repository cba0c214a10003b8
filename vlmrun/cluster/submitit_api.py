"""Every use of submitit's private API, in one place: a newer submitit may change any of it.

vlmrun goes through submitit's own code where submitit offers no public form of what we need:

1. The sbatch script without submitting it (dry runs, the golden files): `SlurmExecutor.
   _make_submission_file_text(executor._submitit_command_str, uid)`, which is exactly what
   `submit` writes; the script runs `python -u -m submitit.core._submit <folder>`.
2. A held submission (`HeldSlurmExecutor`): `_make_submission_command` returns `sbatch --hold`, so
   the submitter records the job before it may start.
3. A requeue decided by node 0 after the attempt ended (`requeue_this_job`): what submitit's own
   USR2 handler does, `job_environment._checkpoint(delayed, pickle, countdown)` (re-pickle through
   our `checkpoint()`) then `JobEnvironment._requeue(countdown)` (`scontrol requeue`).
4. The time-limit requeues left: submitit keeps a count of its own in the pickled submission
   (`DelayedSubmission._timeout_countdown`; its USR2 handler, which still runs while the node starts,
   refuses to requeue below zero). vlmrun's count is the one in job.json (cluster/requeue.py
   `timeouts_left`): it is written into submitit's at submit (`max_num_timeout`) and at every
   requeue (the countdown above), and never read back from it.

`PRIVATE_API` names each of them with the parameters this module was written against; `api_problems`
says what an installed submitit lacks or changed and `require_api` refuses to go on naming it (at
submit, and before a requeue). pyproject.toml pins submitit below the next minor release, and
tests/test_submitit_api.py checks every entry, so an upgrade that changes one fails loudly.
"""

from __future__ import annotations

import contextlib
import importlib
import inspect
import io
import sys
from pathlib import Path
from typing import NoReturn

from submitit import SlurmExecutor
from submitit.core import job_environment, utils

from vlmrun.errors import CheckFailed

# dotted name -> its parameters, "property", "attribute" (set by DelayedSubmission.set_timeout) or "module"
PRIVATE_API: dict[str, tuple[str, ...] | str] = {
    "submitit.core._submit": "module",
    "submitit.core.job_environment._checkpoint": ("delayed", "filepath", "countdown"),
    "submitit.core.job_environment.JobEnvironment._requeue": ("self", "countdown"),
    "submitit.core.utils.DelayedSubmission._timeout_countdown": "attribute",
    "submitit.slurm.slurm.SlurmExecutor._make_submission_command": ("self", "submission_file_path"),
    "submitit.slurm.slurm.SlurmExecutor._make_submission_file_text": ("self", "command", "uid"),
    "submitit.slurm.slurm.SlurmExecutor._submitit_command_str": "property",
    "submitit.slurm.slurm.SlurmJobEnvironment._requeue": ("self", "countdown"),
}


class SubmititChanged(CheckFailed):
    """The installed submitit lacks a private API vlmrun relies on, or changed its signature."""


class SbatchFailed(CheckFailed):
    """sbatch refused the job or could not reach the controller; the message is sbatch's own."""


class RequeueFailed(CheckFailed):
    """submitit could not re-pickle the submission for the requeue (the job ends, resumable)."""


def api_problem(name: str) -> str | None:
    """What is wrong with private API `name` (a key of PRIVATE_API) in the installed submitit, or None."""
    want = PRIVATE_API[name]
    if want == "module":
        try:
            importlib.import_module(name)
        except ImportError as e:
            return f"{name}: missing ({e})"
        return None
    try:
        found = _resolve(name)
    except (ImportError, AttributeError):
        return f"{name}: missing"
    if want == "property":
        return None if isinstance(found, property) else f"{name}: no longer a property ({type(found).__name__})"
    if want == "attribute":
        return None if found == 7 else f"{name}: DelayedSubmission.set_timeout(_, 7) no longer sets it to 7"
    try:
        params = tuple(inspect.signature(found).parameters)
    except (TypeError, ValueError):
        return f"{name}: not a function any more ({type(found).__name__})"
    return None if params == want else f"{name}: signature ({', '.join(params)}), vlmrun expects ({', '.join(want)})"


def api_problems() -> list[str]:
    """Every private API of PRIVATE_API that the installed submitit lacks or changed, one line each."""
    return [p for name in PRIVATE_API if (p := api_problem(name)) is not None]


def require_api() -> None:
    """Raise SubmititChanged naming each private API the installed submitit lacks or changed."""
    if problems := api_problems():
        version = getattr(sys.modules.get("submitit"), "__version__", "?")
        raise SubmititChanged(
            f"the installed submitit {version} changed what vlmrun relies on: {'; '.join(problems)}; "
            "install the version pyproject.toml pins (requirements/tested.txt)"
        )


def _resolve(name: str):
    """The object `name` names, looked up without running descriptors (a property stays a property)."""
    if name == "submitit.core.utils.DelayedSubmission._timeout_countdown":  # an instance attribute
        delayed = utils.DelayedSubmission(print)
        delayed.set_timeout(1, 7)
        return delayed._timeout_countdown
    parts = name.split(".")
    for split in range(len(parts) - 1, 0, -1):  # the longest importable prefix is the module
        try:
            found = importlib.import_module(".".join(parts[:split]))
        except ImportError:
            continue
        for part in parts[split:]:
            found = _own_attribute(found, part)
        return found
    raise ImportError(name)


def _own_attribute(container, part: str):
    """`container.part` as written in its source: on a class only its own attribute (an inherited one,
    like the base JobEnvironment._requeue that does nothing, is not what we rely on), and a property
    as the property. Raises AttributeError when there is none."""
    if not inspect.isclass(container):
        return getattr(container, part)
    if part not in vars(container):
        raise AttributeError(f"{container.__name__} has no {part} of its own")
    return vars(container)[part]


class HeldSlurmExecutor(SlurmExecutor):
    """Submits with `sbatch --hold`: the caller records the job id in job.json, then releases it.

    Without the hold a fast job could write job.json (its attempt) at the same moment as the
    submitter (the job id), and one of the two writes would be lost. A requeue does not hold again.
    """

    def _make_submission_command(self, submission_file_path: Path) -> list[str]:
        return ["sbatch", "--hold", str(submission_file_path)]


class RenderOnlyExecutor(SlurmExecutor):
    """Renders without `srun` on PATH (submitit's constructor refuses that); never submits."""

    @classmethod
    def affinity(cls) -> int:
        return 2


def submission_script(executor: SlurmExecutor) -> str:
    """The exact sbatch script `executor.submit` would write (the job id placeholders unexpanded)."""
    return executor._make_submission_file_text(executor._submitit_command_str, "dry-run")


def submit_held(executor: HeldSlurmExecutor, function) -> str:
    """Submit `function` held; its job id. Raises SbatchFailed with sbatch's message when sbatch fails."""
    try:
        with contextlib.redirect_stderr(io.StringIO()):  # submitit prints sbatch's stderr too: it is in the error
            return executor.submit(function).job_id
    except utils.FailedJobError as e:
        raise SbatchFailed(str(e).strip() or "sbatch failed without a message") from None


def requeue_this_job(timeouts_left: int) -> NoReturn:
    """From inside the job (global rank 0): re-pickle the submission through its `checkpoint()` with
    `timeouts_left` as submitit's countdown, `scontrol requeue` the job and exit as submitit's USR2
    handler does (no result pickle: the job is not over). Raises SubmititChanged, RequeueFailed (the
    checkpoint returned nothing), or CalledProcessError/TimeoutExpired when `scontrol` fails."""
    require_api()
    env = job_environment.JobEnvironment()
    pickle = env.paths.submitted_pickle
    delayed = utils.DelayedSubmission.load(pickle)
    countdown = max(0, timeouts_left)
    problem = job_environment._checkpoint(delayed, pickle, countdown)
    if problem:
        raise RequeueFailed(f"submitit did not checkpoint the submission: {problem}")
    env._requeue(countdown)
    sys.stdout.flush()
    sys.exit(-1)
