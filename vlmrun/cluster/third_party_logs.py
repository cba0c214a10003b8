"""Third-party log lines, levelled down: the console and the attempt log carry ours and everyone's
errors; the libraries' chatter goes to the attempt's third-party log (logs/attempt-<K>.third-party.log).

1. Records of the node process: ours (`vlmrun.*`) from INFO, anyone's from ERROR, on the console and in
   the attempt log; the libraries' below ERROR (energon's "Regenerating dataset UUID...", Ray's own
   logger, Python warnings through `logging.captureWarnings`) only in the third-party log.
2. Lines Ray forwards from its workers (the stdout and stderr of our actors, on every node): C++
   libraries log with glog (Mooncake's clients ~20 lines each at start, among them an E-level
   "metadata not found" in a healthy run: Mooncake's failures reach us as failed calls, and the
   plane's watchdog names a dead master), torch logs in glog's format behind "[rank<k>]:" (and its
   C++ part in c10's, as "[W1201 ... socket.cpp:207] [c10d] ..." on a node without a hostname), a Python
   warning comes as a "file:line: XWarning: ..." line with its source line under it, TransferQueue
   logs every retry of a failed put or get at ERROR with the keys it tried (and raises to the caller
   once it gives up), and the raylet reports every killed worker in a long paragraph. Those go to the
   third-party log; everything else a worker prints (a traceback, a fatal or critical line) stays on
   the console.
3. Ray's own logger (its start-up lines, the one about token authentication among them) writes into
   ours from before `ray.init`, so its records are levelled down like any library's. (Setting
   RAY_AUTH_MODE=token instead would silence that line, but Ray reads the mode when it is imported: on
   SLURM, where our Ray runs with RAY_AUTH_MODE=disabled, the driver would then disagree with it.)

`route_ray_logs()` wraps a private seam of Ray 2.60: `ray._private.worker.print_to_stdstream(batch,
ignore_prefix)`, through which the driver prints every line forwarded from a worker (the handler
`ray.init` registers is a partial of it, taken at init) and every raylet's error report;
tests/test_third_party_logs.py pins it.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable, Iterable

WORKERS_LOGGER = "ray.workers"  # a library's name: lines filed under it go to the third-party log
#: glog's line prefix, as Mooncake and torch write it ("[rank0]:W1201 ... 12686 file.py:57] "), or as
#: torch's C++ (c10) writes it ("[W1201 11:03:14.822049513 socket.cpp:207] ")
_GLOG = re.compile(
    r"^(\[rank\d+\]:)?(\[[IWE]\d{4} \d\d:\d\d:\d\d\.\d+|[IWE]\d{4} \d\d:\d\d:\d\d\.\d+\s+\d+) \S+:\d+\] "
)
_PY_WARNING = re.compile(r"^\S.*\.py:\d+: \w*Warning: ")
_TRANSFER_QUEUE = re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d+ - (DEBUG|INFO|WARNING|ERROR) - transfer_queue\.")
_CHATTER = (
    "WARNING: Logging before InitGoogleLogging() is written to STDERR",
    "A worker died or was killed while executing a task by an unexpected system error.",
)


def is_ours(record: logging.LogRecord) -> bool:
    return record.name == "vlmrun" or record.name.startswith("vlmrun.")


class OursAndErrors(logging.Filter):
    """What the console and the attempt log show (module doc)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return is_ours(record) or record.levelno >= logging.ERROR


class LibrariesBelowError(logging.Filter):
    """What only the third-party log holds: the complement of OursAndErrors."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not is_ours(record) and record.levelno < logging.ERROR


def is_chatter(line: str) -> bool:
    """Whether a line a worker printed is a library's chatter (module doc)."""
    return any(p.match(line) for p in (_GLOG, _PY_WARNING, _TRANSFER_QUEUE)) or line.startswith(_CHATTER)


def split_worker_lines(lines: Iterable[str]) -> tuple[list[str], list[str]]:
    """(kept, chatter) of a batch of a worker's lines; an indented line under chatter (a warning's
    source line) is chatter too."""
    kept: list[str] = []
    chatter: list[str] = []
    previous_was_chatter = False
    for line in lines:
        previous_was_chatter = is_chatter(line) or (previous_was_chatter and line[:1].isspace())
        (chatter if previous_was_chatter else kept).append(line)
    return kept, chatter


def route_ray_logs() -> None:
    """In the driver, before `ray.init`: Ray's logger writes into ours (so its records are levelled down
    like every library's), and the chatter among the lines Ray prints for its workers and its raylets
    goes to the third-party log (module doc). Idempotent."""
    import ray._private.worker as ray_worker  # first: importing ray configures its logger (own handler, no propagation)

    ray_logger = logging.getLogger("ray")
    ray_logger.handlers.clear()
    ray_logger.propagate = True

    if not getattr(ray_worker.print_to_stdstream, "files_chatter", False):
        ray_worker.print_to_stdstream = _filing_chatter(ray_worker.print_to_stdstream)


def _filing_chatter(print_to_stdstream: Callable[[dict, bool], None]) -> Callable[[dict, bool], None]:
    files = logging.getLogger(WORKERS_LOGGER)

    def filed(batch: dict, ignore_prefix: bool) -> None:
        kept, chatter = split_worker_lines(batch.get("lines", []))
        if chatter:
            who = " ".join(str(x) for x in (batch.get("actor_name") or batch.get("task_name"), batch.get("pid")) if x)
            for line in chatter:
                files.info("(%s) %s", who, line)
        if kept or not chatter:
            print_to_stdstream({**batch, "lines": kept}, ignore_prefix)

    filed.files_chatter = True
    return filed
