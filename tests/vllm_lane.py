"""What the vllm lane's tests share (tests/test_vllm_lane_*.py, `make test-vllm`): the engine's environment
built by `make vllm-cpu`, and the engine processes of a run.

Without the environment a lane test skips naming `make vllm-cpu`; in CI (CI set) it fails instead:
.ci/run builds the environment, so a missing one there is a broken lane, not a choice.
"""

from __future__ import annotations

import os

import pytest

from vlmrun.errors import InputError

#: The Ray actor's process name of an engine (vlmrun/generation/vllm_engine.py).
ENGINE_PROCESS = "ray::VllmEngine"


def require_engine_env():
    """The CPU engine environment (vlmrun/generation/vllm_env.py), or a skip (a failure in CI) naming how to build it."""
    from vlmrun.generation.vllm_env import engine_environment

    try:
        return engine_environment(None, on_gpu=False)
    except InputError as e:
        if os.environ.get("CI"):
            pytest.fail(f"the vllm lane runs in CI, and: {e} (.ci/run builds it: make vllm-cpu)")
        pytest.skip(f"no vllm engine environment (make vllm-cpu): {e}")


def engine_processes() -> dict[int, str]:
    """pid -> command line of every live vllm engine process of this user on the host."""
    import psutil

    found = {}
    for p in psutil.process_iter(["name", "cmdline", "uids"]):
        if p.info["name"] == ENGINE_PROCESS and p.info["uids"] and p.info["uids"].real == os.getuid():
            found[p.pid] = " ".join(p.info["cmdline"] or [])
    return found
