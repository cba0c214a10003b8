"""The `transfer_queue` adapter on a real (local) Ray: simple storage units and Mooncake over TCP.

The same property as the local plane (tests/test_plane_wire.py): random ragged batches come back
exactly, for a dp shard of the ids and a subset of the fields, and a later stage adds a column. Then
a worker actor does what a GRPO rank does: reads its shard, writes logprobs back for the driver.
A SIGKILLed server is named as dead within seconds, and a call waiting on it ends at its bound.
"""

from __future__ import annotations

import os
import signal
import time

import pytest
import torch
from hypothesis import given, settings
from test_plane_mooncake_master import free_blocks
from test_plane_wire import (
    HYPOTHESIS,
    assert_same,
    check_put_many_and_get_many,
    check_round_trip,
    ragged_batches,
)

from vlmrun.algorithms.grpo.fields import GrpoStage, partition_spec
from vlmrun.cluster.mooncake import mooncake_unavailable
from vlmrun.cluster.plane_servers import running_plane_servers
from vlmrun.plane.interface import DataPlaneError
from vlmrun.plane.transfer_queue.servers import start_transfer_queue

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]
BACKENDS = [
    "simple",
    pytest.param(
        "mooncake", marks=pytest.mark.skipif(mooncake_unavailable() is not None, reason=str(mooncake_unavailable()))
    ),
]
SIZES = {"segment_bytes": 64 << 20, "buffer_bytes": 16 << 20}  # per client; the tests move a few MB


class PlaneWorker:
    """A GRPO rank's view of the plane: its own client, built from the job's endpoint."""

    def __init__(self, endpoint):
        from vlmrun.plane.transfer_queue.store import TransferQueuePlane

        self.plane = TransferQueuePlane(endpoint, pixel_dtype=torch.bfloat16)

    def logprobs(self, partition: str, shard: list[str]) -> dict:
        """The logprob stage on `shard`, prev then ref: read its fields, write made-up logprobs back, report
        what it saw."""
        spec = self.plane.spec(partition)
        got = self.plane.get(partition, shard, spec.stage_fields(GrpoStage.LOGPROB))
        self.plane.put(partition, shard, {"prev_logprobs": [-r.float() / 1000 for r in got["response_ids"]]})
        ref = self.plane.get(partition, shard, spec.stage_fields(GrpoStage.LOGPROB))
        self.plane.put(partition, shard, {"ref_logprobs": [-r.float() / 500 for r in ref["response_ids"]]})
        return {
            "fields": sorted(got.columns),
            "pixels": [[(tuple(s.shape), s.dtype, float(s.float().sum())) for s in v] for v in got["pixel_values"]],
        }

    def close(self) -> None:
        self.plane.close()


@pytest.fixture(scope="module", params=BACKENDS)
def endpoint(request, ray_local, tmp_path_factory):
    """The job's servers as the node starts them (cluster/plane_servers.py), for one backend."""
    block = free_blocks(1, start=600)[0] if request.param == "mooncake" else None
    log_dir = tmp_path_factory.mktemp("plane-servers")
    with running_plane_servers(
        "transfer_queue", request.param, block=block, host="127.0.0.1", log_dir=log_dir, storage_units=2, **SIZES
    ) as servers:
        assert servers.lost() is None
        yield servers.endpoint


@pytest.fixture(scope="module")
def planes(endpoint):
    """One driver-side client per pixel dtype; closed before the servers stop."""
    from vlmrun.plane.transfer_queue.store import TransferQueuePlane

    planes = {dtype: TransferQueuePlane(endpoint, pixel_dtype=dtype) for dtype in (torch.float32, torch.bfloat16)}
    yield planes
    for plane in planes.values():
        plane.close()


@settings(max_examples=12, **HYPOTHESIS)
@given(batch=ragged_batches())
def test_ragged_batches_round_trip_exactly(planes, batch):
    check_round_trip(planes[batch.pixel_dtype], batch)


def _rollout(n: int = 4) -> tuple[list[str], dict]:
    gen = torch.Generator().manual_seed(0)
    images = [2, 0, 1, 3][:n]
    return [f"r{i}" for i in range(n)], {
        "prompt_ids": [torch.randint(0, 100, (5 + i,), generator=gen) for i in range(n)],
        "mm_token_type_ids": [torch.zeros(5 + i, dtype=torch.long) for i in range(n)],
        "response_ids": [torch.randint(0, 100, (3 + i,), generator=gen) for i in range(n)],
        "response_mask": [torch.ones(3 + i, dtype=torch.bool) for i in range(n)],
        "generation_logprobs": [-torch.rand(3 + i, generator=gen) for i in range(n)],
        "rewards": [torch.tensor(float(i % 2)) for i in range(n)],
        "pixel_values": [[torch.randn(16, 24, generator=gen) for _ in range(k)] for k in images],
        "image_grid_thw": [[torch.tensor([[1, 4, 4]] * k)] if k else [] for k in images],
    }


def test_workers_read_their_shard_and_write_logprobs_back(endpoint, planes):
    import ray

    driver = planes[torch.bfloat16]
    ids, rollout = _rollout()
    driver.register("grpo-step-1", partition_spec("qwen2_5_vl", kl=True, num_samples=len(ids)))
    driver.put("grpo-step-1", ids, rollout)
    workers = [ray.remote(num_cpus=0)(PlaneWorker).remote(endpoint) for _ in range(2)]
    try:
        seen = ray.get([w.logprobs.remote("grpo-step-1", ids[k::2]) for k, w in enumerate(workers)])
        assert seen[0]["fields"] == sorted(
            ("prompt_ids", "response_ids", "mm_token_type_ids", "pixel_values", "image_grid_thw")
        )
        for k, report in enumerate(seen):
            want = [
                [
                    (tuple(s.shape), torch.bfloat16, float(s.bfloat16().float().sum()))
                    for s in rollout["pixel_values"][i]
                ]
                for i in range(k, len(ids), 2)
            ]
            assert report["pixels"] == want
        # the driver sees what the workers wrote, and adds the advantages
        got = driver.get("grpo-step-1", ids, ["prev_logprobs", "rewards"])
        for i, lp in enumerate(got["prev_logprobs"]):
            assert_same(lp, -rollout["response_ids"][i].float() / 1000)
        rewards = got.stack("rewards")
        driver.put("grpo-step-1", ids, {"advantages": list((rewards - rewards.mean()).unbind())})
        train = driver.get("grpo-step-1", ids[1:3], driver.spec("grpo-step-1").stage_fields(GrpoStage.TRAIN))
        assert train.stack("advantages").tolist() == (rewards - rewards.mean())[1:3].tolist()
        assert_same(train["pixel_values"], [[s.bfloat16() for s in rollout["pixel_values"][i]] for i in (1, 2)])
    finally:
        ray.get([w.close.remote() for w in workers])  # Mooncake: a client takes the memory it lent along
        for w in workers:
            ray.kill(w)
        driver.clear("grpo-step-1")
    assert "grpo-step-1" not in driver.partitions()


def test_errors_raise_clearly(planes):
    plane = planes[torch.float32]
    ids, rollout = _rollout(2)
    plane.register("grpo-step-2", partition_spec("qwen2_5_vl", kl=True, num_samples=2))
    try:
        plane.put("grpo-step-2", ids, rollout)
        for call, match in [
            (lambda: plane.get("grpo-step-2", ids, "all"), "explicit"),
            (lambda: plane.get("grpo-step-2", ids, ["logits"]), "unknown field"),
            (lambda: plane.get("grpo-step-2", ids, ["ref_logprobs"]), "not written"),
            (lambda: plane.put("grpo-step-2", ids, {"rewards": rollout["rewards"]}), "already written"),
            (lambda: plane.put("grpo-step-2", ids, {"pixel_values": [torch.randn(2, 2)] * 2}), "list of segments"),
            (
                lambda: plane.register("grpo-step-2", partition_spec("qwen2_5_vl", kl=True, num_samples=2)),
                "already",
            ),
        ]:
            with pytest.raises(DataPlaneError, match=match):
                call()
        assert plane.state_dict()["grpo-step-2"]["ids"] == ids
    finally:
        plane.clear("grpo-step-2")
    assert plane.state_dict() == {}  # nothing left at the step boundary


def test_small_rows_ride_in_the_tags_and_come_back_exact(planes):
    from vlmrun.plane.transfer_queue.store import INLINE_BYTES

    plane = planes[torch.float32]
    ids = ["a#0", "a#1", "a#2"]
    plane.register("tiny", partition_spec("qwen2_5_vl", kl=True, num_samples=3))
    try:
        plane.put("tiny", ids, {"rewards": [torch.tensor(0.5), torch.tensor(-1.0), torch.tensor(2.0)]})
        stored = plane.store._run(plane.store._retrieve("tiny", ids, create=False)).field_names
        assert "rewards" not in stored  # 4 bytes a sample: in the tags, nowhere in storage
        ids_row = [torch.arange(3), torch.arange(INLINE_BYTES // 8 + 1), torch.arange(0)]  # 24 B, 40 B, empty
        mask = [torch.tensor([True, False, True]), torch.ones(5, dtype=torch.bool), torch.ones(0, dtype=torch.bool)]
        plane.put("tiny", ids, {"response_ids": ids_row, "response_mask": mask})
        stored = plane.store._run(plane.store._retrieve("tiny", ["a#1"], create=False)).field_names
        assert "response_ids" in stored and "response_mask" not in stored  # its 40-byte row goes to storage
        got = plane.get("tiny", ids, ["rewards", "response_ids", "response_mask"])
        assert got.stack("rewards").tolist() == [0.5, -1.0, 2.0]
        for name, want in (("response_ids", ids_row), ("response_mask", mask)):
            for a, b in zip(got[name], want, strict=True):
                assert a.dtype == b.dtype and torch.equal(a, b)
    finally:
        plane.clear("tiny")
    assert "tiny" not in plane.partitions()
    plane.register("tiny", partition_spec("qwen2_5_vl", kl=True, num_samples=3))
    plane.put("tiny", ids, {"rewards": [torch.tensor(1.0)] * 3})
    plane.clear("tiny")  # nothing of it in storage (Mooncake's manager refuses to clear such a partition)
    assert "tiny" not in plane.partitions()


def test_put_many_and_get_many_overlap_their_requests_and_check_them_first(planes):
    check_put_many_and_get_many(planes[torch.float32], "tq")  # a refused put leaves no sample behind


@pytest.mark.parametrize("victim", ["storage unit", "controller"])
def test_a_dead_server_is_named_and_a_call_waiting_on_it_ends_at_its_bound(ray_local, victim):
    """What the node's watchdog relies on (cluster/plane_servers.py): Ray reports a SIGKILLed server
    actor dead within seconds, named with its pid, and a client's call gives up at its bound (not
    after TransferQueue's 3 x 200 s for a storage unit, or never for the controller)."""
    import ray

    from vlmrun.plane.transfer_queue.servers import start_transfer_queue, stop_transfer_queue
    from vlmrun.plane.transfer_queue.store import TransferQueuePlane

    servers = start_transfer_queue("simple")
    plane = TransferQueuePlane(servers.endpoint, request_timeout_s=3.0)
    ids, rollout = _rollout(2)
    try:
        plane.register("doomed", partition_spec("qwen2_5_vl", kl=True, num_samples=2))
        plane.put("doomed", ids, rollout)
        assert servers.lost() is None
        (actor,) = [a for a in servers.actors if victim in a.what]
        os.kill(actor.pid, signal.SIGKILL)
        t0 = time.monotonic()
        with pytest.raises(DataPlaneError, match="did not answer within 3 s"):
            plane.get("doomed", ids, ["response_ids", "pixel_values"])
        assert time.monotonic() - t0 < 30  # the bound, not TransferQueue's own retries (3 x 200 s)
        deadline = time.monotonic() + 10
        while (lost := servers.lost()) is None and time.monotonic() < deadline:
            time.sleep(0.1)
        assert lost == f"{actor.describe()} died"
        node = ray.util.get_node_ip_address()  # the one node of this test's Ray
        assert f"TransferQueue {victim}" in lost and f"pid {actor.pid} on {node}" in lost, lost
    finally:
        plane.close()
        stop_transfer_queue(servers)


def test_servers_that_miss_their_start_bound_are_named_and_stopped(ray_local):
    """One bound for all the servers (they start side by side): past it the error names the server
    still starting and the bound, and nothing it started is left in Ray (the GCS's actor table,
    Ray's private `state.actors`: this Ray runs no API server for `ray.util.state`)."""
    from ray._private import state

    def live() -> set[str]:
        return {a for a, info in state.actors().items() if info["State"] != "DEAD"}

    before = live()
    with pytest.raises(TimeoutError, match=r"the TransferQueue controller did not start within 0 s: its process"):
        start_transfer_queue("simple", storage_units=2, deadline_s=0.01)
    deadline = time.monotonic() + 30
    while (left := live() - before) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not left, {a: state.actors()[a]["State"] for a in left}


STARTER_IMPORTS = """
import sys
from vlmrun.plane.transfer_queue import servers
print([servers._server_host(s).__name__ for s in ("controller", "storage")],
      sorted(m for m in ("torch", "transfer_queue", "tensordict") if m in sys.modules))
"""


def test_whoever_starts_the_servers_never_imports_transfer_queue():
    """The servers' actors import TransferQueue in their own processes (and answer with plain addresses):
    the node that starts them never spends the ~2.7 s of CPU of importing it (torch, tensordict,
    torch._dynamo), and Ray's titles still read ray::TransferQueueController, ray::SimpleStorageUnit."""
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", STARTER_IMPORTS], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "['TransferQueueController', 'SimpleStorageUnit'] []"
