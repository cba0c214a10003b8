"""Fixtures shared by several test modules, the suite's lanes and its scheduling under pytest-xdist;
pytest finds them here, no test module imports them.

The lanes, by what a test promises (LANES; `make test` runs all three in one session and prints each
lane's seconds at the end):

- unit: logic with hand-made inputs and small real parts in-process (`make test-fast`);
- e2e: the product end to end: real runs through the CLI, real Ray, spawned ranks (`slow`), the local
  SLURM cluster (`slurm`);
- tools: the smoke runs of tools/ measurements (`tools`), which users do not run but CI keeps working.

A small CLEVR set (64 px, 3 train shards of 32) and the tiny models of every family are built once
per session under pytest's base temp dir. The real runs several modules share, and the one local Ray,
are in tests/shared_runs.py; the CLI as a user's process in tests/vlmrun_cli.py; plain functions the
data-path tests share in tests/data_samples.py.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # before anything imports huggingface_hub

import pytest
from data_samples import FAMILIES, PER_SHARD, SIZE, TRAIN, VAL

pytest_plugins = ["shared_runs"]
SLURM_GROUP = "slurm"
#: The vllm lane's modules (tests/test_vllm_lane_*.py) run together on one worker: each starts engines of
#: a GiB or more, which two workers at once would double on the same small machine.
VLLM_GROUP = "vllm"
#: The tools' lane: each of its tests is a work unit of its own.
TOOLS_MODULE = "test_tools.py"
CHAIN_LINK = re.compile(r"test_\d+_")


#: Seconds each work unit took in a whole run (tests/unit_seconds.json, written by `pytest
#: --write-unit-seconds`): the order in which the units go out, heaviest first.
UNIT_SECONDS = Path(__file__).with_name("unit_seconds.json")
#: A unit the table does not know yet (a new module): one with slow tests goes out among the heavy ones.
NEW_SLOW_UNIT_S, NEW_UNIT_S = 60.0, 1.0
#: The lanes, in the order `make test` reports them, and the marks that put a test in each.
LANES = {"unit": (), "e2e": ("slow", "slurm"), "tools": ("tools",)}


def pytest_addoption(parser):
    parser.addoption(
        "--write-unit-seconds",
        action="store_true",
        help=f"write the seconds of each work unit this run ran (setup, call, teardown) into {UNIT_SECONDS.name}: "
        "the order of the units in the next runs",
    )


def pytest_collection_modifyitems(config, items):
    """The order of the tests, and under pytest-xdist (`make test`: -n 3) each worker's share:

    1. A module runs whole on one worker, in its order: the chains of test_chaos_processes.py and
       test_slurm_sft.py are one run each, and a module fixture may be a real run.
    2. The SLURM modules (tests/test_slurm_*.py) run together, on one worker (one cluster; their jobs
       expect its nodes free); so do the vllm lane's (VLLM_GROUP).
    3. The units go out heaviest first, by their seconds in tests/unit_seconds.json: a worker that
       is free takes the next, so the last units to start are small ones and the workers end together
       (on one run's measured unit times, a simulation of the alphabetical order ends one worker
       ~85 s after the others, ~7% of the run; heaviest first, they end together).
    """
    for item in items:
        if CHAIN_LINK.match(item.name):
            item.add_marker(pytest.mark.chain)
    groups = {item: group_of(item.nodeid) for item in items}
    slow = {groups[item] for item in items if item.get_closest_marker("slow")}
    known = json.loads(UNIT_SECONDS.read_text()) if UNIT_SECONDS.is_file() else {}

    def seconds(group: str) -> float:
        return known.get(group, NEW_SLOW_UNIT_S if group in slow else NEW_UNIT_S)

    items.sort(key=lambda item: -seconds(groups[item]))  # stable: a unit's tests keep their order


_unit_seconds: dict[str, float] = {}
_lane_seconds: dict[str, float] = {}
_lane_tests: dict[str, set[str]] = {}


def lane_of(marks) -> str:
    """The lane of a test with `marks` (names): tools before e2e, e2e before unit."""
    for lane in ("tools", "e2e"):
        if any(mark in marks for mark in LANES[lane]):
            return lane
    return "unit"


def pytest_runtest_logreport(report):
    """Each unit's and each lane's seconds (under pytest-xdist the controller sees every worker's reports)."""
    group = group_of(report.nodeid)
    _unit_seconds[group] = _unit_seconds.get(group, 0.0) + report.duration
    lane = lane_of(report.keywords)
    _lane_seconds[lane] = _lane_seconds.get(lane, 0.0) + report.duration
    _lane_tests.setdefault(lane, set()).add(report.nodeid)


#: A chain: the tests of a module named test_<n>_... (marked `chain` at collection) go on, in order, from
#: where the one before left its run. A link whose predecessor failed is skipped naming it, so the first
#: failure is the one reported (test_chaos_processes.py, test_slurm_sft.py).
_broken_chains: dict[str, str] = {}


def pytest_runtest_makereport(item, call):
    if item.get_closest_marker("chain") is not None and call.excinfo is not None and call.when != "teardown":
        if not call.excinfo.errisinstance(pytest.skip.Exception):
            _broken_chains.setdefault(item.module.__name__, item.name)


def pytest_runtest_setup(item):
    if item.get_closest_marker("chain") is not None and item.module.__name__ in _broken_chains:
        pytest.skip(f"the chain broke at {_broken_chains[item.module.__name__]}: this link goes on from it")


def pytest_terminal_summary(terminalreporter):
    """The seconds each lane's tests took (set-up, call and tear-down, summed over the workers)."""
    if os.environ.get("PYTEST_XDIST_WORKER") or not _lane_seconds:
        return
    lanes = ", ".join(
        f"{lane} {len(_lane_tests[lane])} tests {_lane_seconds[lane]:.0f} s" for lane in LANES if lane in _lane_seconds
    )
    terminalreporter.write_line(f"lanes (test seconds, summed over the workers): {lanes}")


def pytest_sessionfinish(session, exitstatus):
    """With --write-unit-seconds: the units of this run take their seconds in it; the others keep theirs."""
    if session.config.getoption("--write-unit-seconds") and not os.environ.get("PYTEST_XDIST_WORKER"):
        known = json.loads(UNIT_SECONDS.read_text()) if UNIT_SECONDS.is_file() else {}
        table = known | {group: round(s, 1) for group, s in _unit_seconds.items()}
        UNIT_SECONDS.write_text(json.dumps(dict(sorted(table.items(), key=lambda kv: -kv[1])), indent=1) + "\n")


def group_of(nodeid: str) -> str:
    """The work unit of a test under pytest-xdist: its module, SLURM_GROUP for every SLURM module, and each
    test of the tools' lane on its own (independent smoke runs: they spread over the workers)."""
    module = nodeid.split("::")[0]
    if Path(module).name.startswith("test_slurm_"):
        return SLURM_GROUP
    if Path(module).name.startswith("test_vllm_lane_"):
        return VLLM_GROUP
    return nodeid.split("[")[0] if Path(module).name == TOOLS_MODULE else module


def pytest_xdist_make_scheduler(config, log):
    """pytest-xdist hands out work units of `group_of` (its `--dist loadgroup` marks no longer group
    anything under pytest 9: it renames `item._nodeid`, which pytest 9 does not read), in the order
    collected (pytest_collection_modifyitems)."""
    from xdist.scheduler import LoadScopeScheduling

    class ByGroup(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return group_of(nodeid)

        def remove_node(self, node):
            """A worker that died: xdist reports the test it ran as failed; the rest of its work unit goes
            to another worker without that test (LoadScopeScheduling would run it again, where it may kill
            worker after worker, and the run then waits forever)."""
            crashed = super().remove_node(node)
            if crashed is not None:
                for scope, unit in list(self.workqueue.items()):
                    unit.pop(crashed, None)
                    if not any(not done for done in unit.values()):
                        del self.workqueue[scope]
            return crashed

    return ByGroup(config, log)


@pytest.fixture(scope="session", autouse=True)
def shared_tiny_models(tmp_path_factory) -> Path:
    """Every run of the session (every worker's, and the CLI processes they start) takes its tiny model
    from one folder ($VLMRUN_TINY_MODELS): built once per family and seed, not once per run directory."""
    from vlmrun.models.source import SHARED_TINY_MODELS

    base = tmp_path_factory.getbasetemp()
    folder = (base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base) / "vlmrun-tiny-models"
    previous = os.environ.get(SHARED_TINY_MODELS)
    os.environ[SHARED_TINY_MODELS] = str(folder)
    yield folder
    if previous is None:
        os.environ.pop(SHARED_TINY_MODELS, None)
    else:
        os.environ[SHARED_TINY_MODELS] = previous


@pytest.fixture(scope="session", autouse=True)
def user_cache(tmp_path_factory) -> Path:
    """The user's cache folder ($XDG_CACHE_HOME: the data checks of `vlmrun submit`) is the session's, not
    the home directory of whoever runs the tests."""
    base = tmp_path_factory.getbasetemp()
    folder = (base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base) / "user-cache"
    previous = os.environ.get("XDG_CACHE_HOME")
    os.environ["XDG_CACHE_HOME"] = str(folder)
    yield folder
    if previous is None:
        os.environ.pop("XDG_CACHE_HOME", None)
    else:
        os.environ["XDG_CACHE_HOME"] = previous


@pytest.fixture(scope="session")
def clevr_set(tmp_path_factory) -> Path:
    from vlmrun.datasets.clevr import generate_clevr, read_complete

    path = tmp_path_factory.getbasetemp() / "vlmrun-data-clevr64"
    if read_complete(path) is None:
        generate_clevr(path, train=TRAIN, val=VAL, image_size=SIZE, seed=0, samples_per_shard=PER_SHARD)
    return path


@pytest.fixture(scope="session")
def tiny_dirs(tmp_path_factory) -> dict[str, str]:
    """family -> directory of its tiny model and processor (built from a config, seed 0)."""
    from vlmrun.models.tiny import ensure_tiny_model

    cache = tmp_path_factory.getbasetemp() / "vlmrun-data-models"
    return {family: str(ensure_tiny_model(family, cache, seed=0)) for family in FAMILIES}
