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
