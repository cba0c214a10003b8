"""Failure reasons are one plain line: the root cause and where, without ANSI escapes or Ray's traceback."""

from __future__ import annotations

import errno
import pickle

from vlmrun.cluster.failure import MAX_CHARS, failure_reason, plain
from vlmrun.errors import no_space_left


class RayTaskError(Exception):  # the shape of ray.exceptions.RayTaskError that failure_reason reads
    def __init__(self, text: str, cause: BaseException | None):
        super().__init__(text)
        self.cause = cause


def test_nested_actor_errors_unwrap_to_the_root_cause_and_where():
    root = PermissionError(13, "Permission denied", "/runs/x/checkpoints/tmp_step_3")
    inner = RayTaskError("\x1b[36mray::SftWorker.save()\x1b[39m (pid=4242, ip=10.0.0.2)\nTraceback ...\n", root)
    outer = RayTaskError("ray::SftController.run() (pid=17, ip=10.0.0.1)\nTraceback ...", inner)
    reason = failure_reason(outer)
    assert reason.startswith("PermissionError: [Errno 13] Permission denied: '/runs/x/checkpoints/tmp_step_3'")
    assert reason.endswith("(in SftWorker.save, pid 4242 on 10.0.0.2)")
    assert "\n" not in reason and "\x1b" not in reason


def test_a_dead_actor_is_named_with_class_pid_and_node():
    class ActorDiedError(Exception):
        pass

    died = ActorDiedError(
        "The actor died unexpectedly before finishing this task.\n\tclass_name: SftWorker\n\tactor_id: ab\n"
        "\tpid: 7592\n\tnamespace: n\n\tip: 127.0.0.1\nThe actor is dead because its worker process has died."
    )
    reason = failure_reason(RayTaskError("ray::SftController.run() (pid=1, ip=127.0.0.1)", died))
    assert reason == (
        "ActorDiedError: The actor died unexpectedly before finishing this task. "
        "(the SftWorker actor, pid 7592 on 127.0.0.1)"
    )


def test_plain_errors_and_long_messages_stay_one_bounded_line():
    assert failure_reason(ValueError("bad\nsecond line")) == "ValueError: bad"
    assert failure_reason(KeyboardInterrupt()) == "KeyboardInterrupt"
    long = failure_reason(RuntimeError("x" * 5000))
    assert len(long) == MAX_CHARS and long.endswith("...")
    assert plain("\x1b[31mred\x1b[0m text\nmore") == "red text"


def test_a_full_disk_is_said_as_such_whatever_the_writer_raised_over_it(tmp_path):
    """torch.save's error on a full disk names a zip position; the ENOSPC it met is its context."""
    torch_error = RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 1559360 vs 1559252")
    torch_error.__context__ = OSError(errno.ENOSPC, "No space left on device")
    assert failure_reason(torch_error) == "no space left on device"
    named = OSError(errno.ENOSPC, "No space left on device", str(tmp_path / "metrics.jsonl"))
    assert failure_reason(named).startswith(f"no space left on device ({tmp_path / 'metrics.jsonl'}, ")


def test_a_full_disk_in_an_actor_is_the_line_the_writer_made_and_where():
    full = pickle.loads(pickle.dumps(no_space_left("/runs/x/checkpoints", 6 << 20)))  # as it crosses Ray
    inner = RayTaskError("ray::SftWorker.save() (pid=4242, ip=10.0.0.2)\nTraceback ...", full)
    reason = failure_reason(RayTaskError("ray::SftController.run() (pid=17, ip=10.0.0.1)", inner))
    assert reason.startswith("no space left on device (/runs/x/checkpoints, ") and " free, 6.0 MiB needed)" in reason
    assert reason.endswith("(in SftWorker.save, pid 4242 on 10.0.0.2)") and full.needed == 6 << 20
