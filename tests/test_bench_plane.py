"""`vlmrun bench-plane`: the data plane's wire against a plain copy, and put/get per adapter, as JSON and
as a table with each ratio's spread over its rounds."""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SPREAD_KEYS = {"median", "min", "max", "q1", "q3", "rounds"}


def vlmrun_json(*args: str, timeout: int = 240) -> dict:
    proc = subprocess.run(
        [sys.executable, "-m", "vlmrun.cli", *args, "--json"], cwd=ROOT, capture_output=True, text=True, timeout=timeout
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout)


def finite(x) -> bool:
    return isinstance(x, int | float) and math.isfinite(x) and x > 0


def test_bench_plane_local_wire_and_adapter():
    d = vlmrun_json("bench-plane", "--adapters", "local", "--samples", "3", "--rows", "64", "--repeats", "3")
    assert {"payload_mb", "samples", "images", "repeats", "wire", "adapters", "torch_threads", "cpus"} <= set(d)
    wire = d["wire"]
    assert all(finite(wire[k]) for k in ("encode_decode_mb_s", "plain_copy_one_buffer_mb_s"))
    spread = wire["wire_over_one_buffer_copy"]
    assert set(spread) == SPREAD_KEYS and spread["rounds"] == 3 and spread["min"] <= spread["median"] <= spread["max"]
    assert set(d["adapters"]) == {"local"} and finite(d["adapters"]["local"]["put_mb_s"])


def test_bench_plane_table_shows_the_ratio_with_its_spread():
    proc = subprocess.run(
        [sys.executable, "-m", "vlmrun.cli", "bench-plane", "--adapters", "local", "--samples", "2", "--rows", "32"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        env=os.environ | {"COLUMNS": "200"},
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert re.search(r"one-buffer copy time: [\d.]+x \(median of 5 rounds, [\d.]+-[\d.]+\)", proc.stdout), proc.stdout
    assert "local" in proc.stdout and "put MB/s" in proc.stdout


@pytest.mark.slow
def test_bench_plane_transfer_queue_adapters():
    d = vlmrun_json("bench-plane", "--adapters", "simple,mooncake", "--samples", "2", "--rows", "32", "--repeats", "1")
    assert set(d["adapters"]) == {"transfer_queue/simple", "transfer_queue/mooncake"}
    assert finite(d["adapters"]["transfer_queue/simple"]["get_mb_s"])
    mooncake = d["adapters"]["transfer_queue/mooncake"]
    assert "skipped" in mooncake or finite(mooncake["put_mb_s"])  # skipped names why (no libibverbs, no binary)
