"""Fixtures shared by several test modules; pytest finds them here, no test module imports them.

A small CLEVR set (64 px, 3 train shards of 32) and the tiny models of every family are built once
per session under pytest's base temp dir. The real runs several modules share, and the one local Ray,
are in tests/shared_runs.py; the CLI as a user's process in tests/vlmrun_cli.py; plain functions the
data-path tests share in tests/data_samples.py.
"""

from __future__ import annotations

import os
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # before anything imports huggingface_hub

import pytest
from data_samples import FAMILIES, PER_SHARD, SIZE, TRAIN, VAL

pytest_plugins = ["shared_runs"]
SLURM_GROUP = "slurm"


def pytest_collection_modifyitems(config, items):
    """The order of the tests, and under pytest-xdist (`make test`: -n 3) each worker's share:

    1. A module runs whole on one worker, in its order: the chains of test_chaos_processes.py and
       test_slurm_sft.py are one run each, and a module fixture may be a real run.
    2. The SLURM modules (tests/test_slurm_*.py) run together, on one worker (one cluster; their jobs
       expect its nodes free), and first: their waits on the queue and the time limit overlap the
       other worker's runs.
    3. Then the modules with slow tests, the fast ones last: small work units that even out the tails.
    """
    groups = {item: group_of(item.nodeid) for item in items}
    slow = {groups[item] for item in items if item.get_closest_marker("slow")}
    items.sort(key=lambda item: 0 if groups[item] == SLURM_GROUP else 1 if groups[item] in slow else 2)


def group_of(nodeid: str) -> str:
    """The work unit of a test under pytest-xdist: its module, or SLURM_GROUP for every SLURM module."""
    module = nodeid.split("::")[0]
    return SLURM_GROUP if Path(module).name.startswith("test_slurm_") else module


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
