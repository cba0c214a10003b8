"""Third-party log lines levelled down (cluster/third_party_logs.py), in-process (fast): which lines are a
library's chatter, where each record goes, and the private seam of Ray it wraps.

That a real run's console and attempt log stay quiet is asserted on real runs in tests/test_grpo_e2e.py.
With the console attached, the attempt log holds what the console shows (cluster/console_tee.py): here in
a process of its own; on real `--wait` runs in tests/test_over_length_runs.py and tests/test_grpo_rewards.py.
"""

from __future__ import annotations

import inspect
import logging
import os
import subprocess
import sys
import textwrap

import pytest

from vlmrun.cluster.third_party_logs import (
    WORKERS_LOGGER,
    LibrariesBelowError,
    OursAndErrors,
    is_chatter,
    route_ray_logs,
    split_worker_lines,
)

CHATTER = [
    "WARNING: Logging before InitGoogleLogging() is written to STDERR",
    "I1201 10:01:27.930886 12686 client_metric.cpp:102] Client metrics enabled (default enabled)",
    "E1201 10:01:27.967993 12686 transfer_metadata_plugin.cpp:292] GET http://127.0.0.1:15369/metadata?key=x "
    "http=404 body: metadata not found",
    "W1201 10:01:27.967999 12686 transfer_metadata.cpp:1115] Failed to retrieve segment descriptor",
    "[rank0]:W1201 10:01:35.154000 12686 /venv/torch/fx/_symbolic_trace.py:57] is_fx_tracing will return true",
    "[W1201 11:03:14.822049513 socket.cpp:207] [c10d] The hostname of the client socket cannot be retrieved.",
    "/venv/lib/python3.11/site-packages/foo/bar.py:12: DeprecationWarning: use baz",
    "2026-12-01 10:14:51,771 - ERROR - transfer_queue.storage.clients.mooncake_client - batch_get_into failed "
    "for keys ['16@response_ids', '17@response_ids']. Retrying up to 3 times...",
    "A worker died or was killed while executing a task by an unexpected system error. To troubleshoot ...",
]
KEPT = [
    "Traceback (most recent call last):",
    '  File "/work/vlmrun/algorithms/grpo/worker.py", line 12, in score',
    "RuntimeError: step 3: the controller's part of it failed",
    "F1201 10:01:27.930886 12686 real_client.cpp:9] Check failed: buffer != nullptr",  # glog FATAL
    "2026-12-01 10:14:51,771 - CRITICAL - transfer_queue.controller - out of memory",
    "vlmrun: rank 1 lost its loader shard",
]


@pytest.mark.parametrize("line", CHATTER)
def test_libraries_chatter_is_recognized(line):
    assert is_chatter(line)


@pytest.mark.parametrize("line", KEPT)
def test_errors_and_our_lines_are_not_chatter(line):
    assert not is_chatter(line)


def test_a_warning_s_source_line_goes_with_it_and_a_traceback_stays_whole():
    warning = next(line for line in CHATTER if "Warning: " in line)
    lines = [warning, "  warnings.warn(", *KEPT[:3], CHATTER[1]]
    kept, chatter = split_worker_lines(lines)
    assert kept == KEPT[:3]  # the traceback's indented line follows a kept line: kept
    assert chatter == [warning, "  warnings.warn(", CHATTER[1]]


def record(name: str, level: int) -> logging.LogRecord:
    return logging.LogRecord(name, level, __file__, 1, "msg", None, None)


def test_ours_from_info_and_everyone_s_errors_on_the_console_the_rest_in_the_third_party_log():
    console, third_party = OursAndErrors(), LibrariesBelowError()
    cases = [
        ("vlmrun", logging.INFO, True),
        ("vlmrun.cluster.node", logging.WARNING, True),
        ("megatron.energon.flavors.webdataset.prepare", logging.INFO, False),
        ("py.warnings", logging.WARNING, False),
        ("ray", logging.WARNING, False),
        (WORKERS_LOGGER, logging.INFO, False),
        ("transfer_queue.client", logging.ERROR, True),
        ("vlmrunner", logging.INFO, False),  # not ours: only the vlmrun package is
    ]
    for name, level, shown in cases:
        r = record(name, level)
        assert console.filter(r) == shown and third_party.filter(r) != shown, name


def test_ray_s_seam_is_wrapped_once_and_files_the_chatter(monkeypatch, caplog, capsys):
    """Pins the private seam of Ray (module doc of third_party_logs.py): an upgrade that renames it fails here."""
    import ray._private.worker as ray_worker

    assert list(inspect.signature(ray_worker.print_to_stdstream).parameters) == ["data", "ignore_prefix"]
    assert "print_to_stdstream(" in inspect.getsource(ray_worker.listen_error_messages)  # the raylets' reports
    printed = []
    monkeypatch.setattr(ray_worker, "print_to_stdstream", lambda data, ignore_prefix: printed.append(data["lines"]))
    monkeypatch.setattr(logging.getLogger("ray"), "handlers", list(logging.getLogger("ray").handlers))
    monkeypatch.setattr(logging.getLogger("ray"), "propagate", False)
    route_ray_logs()
    wrapped = ray_worker.print_to_stdstream
    route_ray_logs()
    assert ray_worker.print_to_stdstream is wrapped  # idempotent: wrapped once
    with caplog.at_level(logging.INFO, logger=WORKERS_LOGGER):
        ray_worker.print_to_stdstream({"lines": [CHATTER[1], KEPT[0]], "pid": 12, "actor_name": "GrpoWorker"}, False)
        ray_worker.print_to_stdstream({"lines": [CHATTER[-1]], "pid": "raylet"}, False)
    assert printed == [[KEPT[0]]]  # a batch of chatter alone prints nothing
    assert [r.getMessage() for r in caplog.records] == [f"(GrpoWorker 12) {CHATTER[1]}", f"(raylet) {CHATTER[-1]}"]
    assert logging.getLogger("ray").propagate and not logging.getLogger("ray").handlers


@pytest.mark.slow
def test_a_ray_started_after_the_routing_prints_no_token_line():
    """A fresh node process (ray not imported yet, RAY_AUTH_MODE unset: a local run's case): Ray's start-up
    warning about token authentication reaches the console neither raw nor through our handler."""
    code = textwrap.dedent(
        """
        import logging, os, sys
        from vlmrun.cluster.ray.local import start_local_ray
        from vlmrun.cluster.third_party_logs import OursAndErrors, route_ray_logs
        handler = logging.StreamHandler(sys.stderr)
        handler.addFilter(OursAndErrors())
        logging.getLogger().addHandler(handler)
        logging.getLogger().setLevel(logging.INFO)
        route_ray_logs()
        import ray
        start_local_ray(f"token-line-{os.getpid()}", 1)
        ray.shutdown()
        """
    )
    env = {k: v for k, v in os.environ.items() if k != "RAY_AUTH_MODE"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=180)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "Token authentication" not in out.stdout + out.stderr, out.stderr[-3000:]


TEED = """
import os, subprocess, sys
from pathlib import Path
from vlmrun.cluster.console_tee import ConsoleTee
tee = ConsoleTee(Path(sys.argv[1]))
print("ours, on stdout")
print("ours, on stderr", file=sys.stderr)
os.write(1, b"a library's C part\\n")
subprocess.run([sys.executable, "-c", "import sys; print('a process it started', file=sys.stderr)"])
tee.log_only("the traceback, for the log only\\n")
print("after it", file=sys.stderr)
tee.close()
print("after the attempt: the console only", file=sys.stderr)
"""


@pytest.mark.parametrize("shared", [True, False], ids=["one-console", "stdout-and-stderr-apart"])
def test_the_attempt_log_holds_what_the_console_shows_whoever_writes_it(tmp_path, shared):
    log = tmp_path / "attempt-0.log"
    err = subprocess.PIPE if not shared else subprocess.STDOUT
    out = subprocess.run(
        [sys.executable, "-c", TEED, str(log)], stdout=subprocess.PIPE, stderr=err, text=True, timeout=60
    )
    assert out.returncode == 0, (out.stdout, out.stderr)
    console = (out.stdout + (out.stderr or "")).splitlines()
    logged = log.read_text().splitlines()
    shown = ["ours, on stdout", "ours, on stderr", "a library's C part", "a process it started", "after it"]
    assert sorted(logged) == sorted([*shown, "the traceback, for the log only"])
    assert logged.index("the traceback, for the log only") == len(logged) - 2  # after all written before it
    assert sorted(console) == sorted([*shown, "after the attempt: the console only"])
    if shared:  # one console: the log keeps the console's order
        assert logged == [*shown[:4], "the traceback, for the log only", "after it"]
        assert console == [*shown, "after the attempt: the console only"]
