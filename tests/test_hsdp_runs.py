"""HSDP through the CLI on CPU: `parallel.dp_shard: 2` with dp=4 (2 replicas x 2 shards, a 2-D mesh) gives
the numbers of the flat FSDP2 layout over the same 4 ranks, within fp32 rounding (the gradient sums are
taken in another order: a reduce-scatter inside each pair of ranks, then an all-reduce across the pairs,
against one reduce-scatter over all four), on the same samples; `vlmrun compare` says so."""

from __future__ import annotations

import json

import pytest
from shared_runs import submit
from vlmrun_cli import job, sets, vlmrun

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

STEPS = 3
LAYOUT = ["parallel.dp=4", "parallel.fsdp=true", "cluster.cpus_per_node=4", f"train.max_steps={STEPS}"]
#: The relative difference allowed: fp32 sums of 4 terms in another order, over a few steps.
RTOL = 1e-5


def test_hsdp_two_by_two_gives_the_flat_layouts_numbers_within_rounding(run_data, tmp_path):
    flat = submit(tmp_path / "flat", *run_data, *sets(*LAYOUT, "train.val_samples=0"))
    hsdp = submit(tmp_path / "hsdp", *run_data, *sets(*LAYOUT, "parallel.dp_shard=2", "train.val_samples=0"))
    assert job(hsdp)["attempts"][0]["policy_layout"] == "HSDP: 2 replicas x 2 shards (FSDP2)"
    assert job(flat)["attempts"][0]["policy_layout"] == "FSDP2 over 4 ranks"
    cmp = vlmrun("compare", str(flat), str(hsdp), "--rtol", str(RTOL), "--json", "--out", str(tmp_path / "cmp"))
    d = json.loads(cmp.stdout)
    assert cmp.returncode == 0 and d["verdict"] == "match", cmp.stdout + cmp.stderr[-2000:]
    assert d["steps_compared"] == STEPS and d["sample_ids_identical"]
    assert d["max_rel_diff"]["loss"] <= RTOL and d["max_rel_diff"]["grad_norm"] <= RTOL
