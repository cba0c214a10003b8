"""The worker group on a real (local) Ray: one actor per rank, and each dispatch reaches the ranks it names."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from vlmrun.config.parallel import ParallelConfig
from vlmrun.distributed.topology import plan_placement
from vlmrun.distributed.worker_group import Placement, RankActor, WorkerGroup, side_call

pytestmark = pytest.mark.slow


class EchoRank(RankActor):
    def __init__(self, *, rank: int, tag: str):
        self.rank, self.tag, self.closed = rank, tag, False

    def who(self, payload=None) -> tuple:
        return (self.rank, self.tag, payload)

    def collecting(self) -> bool:
        import gc

        return gc.isenabled()

    def shutdown(self) -> None:
        self.closed = True

    def step(self, victim: int, flag: str) -> int:
        """`victim` dies; the other ranks fail first, as a collective does when a peer's socket closes
        before Ray has noticed that the peer's process is gone."""
        import time

        if self.rank == victim:
            Path(flag).touch()  # the peer sees its link break now ...
            time.sleep(1.0)  # ... and Ray learns of the death only later
            os._exit(1)
        while not Path(flag).exists():
            time.sleep(0.01)
        raise RuntimeError("Read error: Connection reset by peer")


class WaitingRank(RankActor):
    """A stage call that waits for word from the controller, and the side call that brings it."""

    def __init__(self, *, rank: int):
        import threading

        self.rank, self.word = rank, threading.Event()

    def stage(self) -> bool:
        return self.word.wait(timeout=20)

    @side_call
    def tell(self) -> None:
        self.word.set()

    def shutdown(self) -> None:
        pass


def test_dispatch_strategies_reach_the_ranks_they_name(ray_local):
    plan = plan_placement(ParallelConfig(dp=2, tp=2).layout)  # replica 0 = ranks 0,1; replica 1 = ranks 2,3
    group = WorkerGroup(EchoRank, plan, Placement(nodes=1), init=lambda rank: {"rank": rank, "tag": f"r{rank}"})
    try:
        assert group.world_size == 4
        assert group.all_ranks("who", "x") == [(r, f"r{r}", "x") for r in range(4)]
        assert group.per_rank("who", lambda rank: {"payload": rank * 10}) == [(r, f"r{r}", r * 10) for r in range(4)]
        assert group.replica_owners("who", lambda shard: {"payload": f"shard{shard}"}) == [
            (0, "r0", "shard0"),
            (2, "r2", "shard1"),
        ]
        assert group.by_dp("who", [{"payload": "a"}, {"payload": "b"}]) == [
            (0, "r0", "a"),
            (1, "r1", "a"),
            (2, "r2", "b"),
            (3, "r3", "b"),
        ]
        with pytest.raises(ValueError, match="one part per data-parallel replica"):
            group.by_dp("who", [{"payload": "a"}])
        addr, port = group.rendezvous()
        assert addr == group.node_addresses()[0] and 0 < port < 65536
    finally:
        group.shutdown()


def test_replicas_reach_every_rank_of_each_replica_and_collect_from_the_owning_rank(ray_local):
    from vlmrun.distributed.topology import Role

    plan = plan_placement(ParallelConfig(dp=2, pp=2).layout)  # replica 0 = ranks 0 (stage 0), 2 (stage 1)
    group = WorkerGroup(EchoRank, plan, Placement(nodes=1), init=lambda rank: {"rank": rank, "tag": f"r{rank}"})
    try:
        reached = group.all_ranks("who")
        assert group.collect(reached, Role.OWNER) == [(0, "r0", None), (1, "r1", None)]
        assert group.collect(reached, Role.RESULT) == [(2, "r2", None), (3, "r3", None)]  # the last stage's
        assert group.replicas("who", lambda shard: {"payload": f"shard{shard}"}) == [
            (0, "r0", "shard0"),
            (1, "r1", "shard1"),
        ]
        assert group.replicas("who", lambda shard: {"payload": shard}, Role.RESULT) == [(2, "r2", 0), (3, "r3", 1)]
    finally:
        group.shutdown()


def test_a_dead_rank_is_the_error_raised_not_the_errors_of_its_peers(ray_local, tmp_path):
    import ray

    plan = plan_placement(ParallelConfig(dp=2).layout)
    group = WorkerGroup(EchoRank, plan, Placement(nodes=1), init=lambda rank: {"rank": rank, "tag": ""})
    try:
        # rank 0's error comes first in rank order; plain ray.get would raise it and name no culprit
        with pytest.raises(ray.exceptions.RayActorError):
            group.all_ranks("step", 1, str(tmp_path / "link-broken"))
    finally:
        ray.kill(group.workers[0])
        from ray.util.placement_group import remove_placement_group

        remove_placement_group(group.pg)


def test_a_side_call_reaches_a_rank_busy_with_a_stage_call(ray_local):
    import ray

    plan = plan_placement(ParallelConfig(dp=2).layout)
    group = WorkerGroup(WaitingRank, plan, Placement(nodes=1), init=lambda rank: {"rank": rank})
    try:
        busy = group.submit_all_ranks("stage")
        assert ray.wait(busy, num_returns=2, timeout=1.0)[0] == []  # both wait for word
        group.all_ranks("tell")  # a call in the default group would queue behind the stage: a deadlock
        assert ray.get(busy, timeout=10) == [True, True]
    finally:
        group.shutdown()


def test_placement_strategy_follows_nodes_and_ranks():
    assert Placement(nodes=1).strategy(4) == "PACK"
    assert Placement(nodes=2).strategy(2) == "STRICT_SPREAD"
    assert Placement(nodes=2).strategy(4) == "SPREAD"
    assert Placement(nodes=1, gpus_per_rank=1).bundle() == {"CPU": 1, "GPU": 1}


def test_a_step_gate_lets_a_waiter_through_once_its_step_is_opened():
    import threading

    from vlmrun.distributed.worker_group import StepGate

    gate = StepGate(timeout_s=0.2)
    with pytest.raises(TimeoutError, match="step 1: no word"):
        gate.wait(1)
    gate = StepGate(timeout_s=10)
    threading.Timer(0.05, gate.open, (1, True)).start()
    gate.wait(1)  # returns once opened
    gate.wait(1)  # and stays open for step 1
    gate.open(2, False)
    with pytest.raises(RuntimeError, match="step 2: the controller's part of it failed"):
        gate.wait(2)


def test_freeze_heap_leaves_what_lives_now_out_of_later_collections():
    import gc

    from vlmrun.distributed.worker_group import freeze_heap

    try:
        freeze_heap()
        assert gc.get_freeze_count() > 1000  # torch and the test session's objects
    finally:
        gc.unfreeze()


def test_a_rank_starts_with_the_collector_paused_and_has_it_back_once_set_up(ray_local):
    """vlmrun/startup.py: every Ray worker of a Ray that vlmrun starts runs its set-up hook before it
    imports any actor's code, so a rank starts with the cyclic collector off; `freeze_heap` (what the
    loop asks of every rank after set-up) turns it on again."""
    from ray._private import ray_constants

    from vlmrun.cluster.ray.nodes import SETUP_HOOK_ENV

    assert set(SETUP_HOOK_ENV) == {ray_constants.WORKER_PROCESS_SETUP_HOOK_ENV_VAR}  # Ray's own name for it
    plan = plan_placement(ParallelConfig(dp=2).layout)
    group = WorkerGroup(EchoRank, plan, Placement(nodes=1), init=lambda rank: {"rank": rank, "tag": ""})
    try:
        assert group.all_ranks("collecting") == [False, False]
        group.all_ranks("freeze_heap")
        assert group.all_ranks("collecting") == [True, True]
    finally:
        group.shutdown()


def test_importing_vlmrun_changes_no_collector_the_command_line_and_the_node_pause_theirs(tmp_path):
    """A library user, a tool, a test, even a process that looks like a Ray worker: importing vlmrun and
    every package of it leaves the collector as it was (on or off, its thresholds). The command line's
    entry point and the node's turn it off for their start (COMMAND_PAUSE_S at most), `resume` on again."""
    import subprocess
    import sys

    packages = [
        p.name for p in (Path(__file__).resolve().parents[1] / "vlmrun").iterdir() if (p / "__init__.py").exists()
    ]
    imports = "import importlib, gc, vlmrun; " + "; ".join(f"importlib.import_module('vlmrun.{p}')" for p in packages)
    state = "(gc.isenabled(), gc.get_threshold())"
    plain = f"import gc; gc.set_threshold(500, 7, 3); was = {state}; {imports}; print(was == {state})"
    off = f"import gc; gc.disable(); {imports}; print(gc.isenabled())"
    cli = (
        "import gc, vlmrun.cli as cli, vlmrun.startup as s; was = gc.isenabled(); "
        "cli.run = lambda app: print(was, gc.isenabled(), s.COMMAND_PAUSE_S <= 60, end=' '); cli.main(); "
        "s.resume(); print(gc.isenabled())"
    )
    node = (  # the node's main up to where it reads its arguments
        "import gc, vlmrun.cluster.node as node; was = gc.isenabled(); "
        "node._parse = lambda argv: print(was, gc.isenabled(), end=' ') or exit(0); node.main([])"
    )
    (tmp_path / "default_worker.py").write_text(plain)  # what Ray's worker processes run as __main__
    seen = [
        subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=120).stdout.strip()
        for args in (["-c", plain], [str(tmp_path / "default_worker.py")], ["-c", off], ["-c", cli], ["-c", node])
    ]
    assert len(packages) > 10 and "checkpoint" in packages and "rewards" in packages
    assert seen == ["True", "True", "False", "True False True True", "True False"]


def test_ranks_are_ordered_by_node_so_a_shard_group_stays_on_one():
    from vlmrun.distributed.worker_group import ranks_by_node

    assert ranks_by_node(["a", "b", "a", "b"]) == [0, 2, 1, 3]  # SPREAD's round robin, put in node order
    assert ranks_by_node(["b", "a", "a", "b", "c"]) == [0, 3, 1, 2, 4]  # rank 0 keeps bundle 0
    assert ranks_by_node(["x"] * 3) == [0, 1, 2]


# ---------------------------------------------------------------- the node's verdict, to the controller


class VerdictTaker:
    """A controller's side of the verdict's handoff: it takes the verdict, or refuses it."""

    def __init__(self, refuse: bool):
        self.refuse, self.got = refuse, None

    def checkpoint_verified(self, found, skipped, error) -> None:
        if self.refuse:
            raise ValueError("cannot take this verdict")
        self.got = (found, skipped, error)

    def taken(self):
        return self.got


def handed(handoff, verdict) -> None:
    """The verdict's Future completes (the node's hash is done): its callback hands it over."""
    from concurrent.futures import Future

    done = Future()
    done.add_done_callback(handoff.hand)
    done.set_result(verdict)


def test_a_verdict_reaches_the_controller_and_a_failed_handoff_fails_the_driver(ray_local):
    import time

    import ray

    from vlmrun.algorithms.common.driver import VerdictHandoff, VerdictNotHanded

    taker = ray.remote(VerdictTaker).remote(refuse=False)
    ok = VerdictHandoff(taker)
    handed(ok, ("step_4", ["skipped step_6: damaged"]))
    deadline = time.monotonic() + 30
    while ok._sent is not None and time.monotonic() < deadline:
        ok.check()  # delivered: nothing raised, and nothing more to watch
        time.sleep(0.05)
    assert ray.get(taker.taken.remote()) == ("step_4", ["skipped step_6: damaged"], None)

    refusing = VerdictHandoff(ray.remote(VerdictTaker).remote(refuse=True))
    handed(refusing, ("step_4", []))
    with pytest.raises(VerdictNotHanded, match=r"could not be handed to the controller \(.*cannot take this verdict"):
        while time.monotonic() < deadline:  # the driver's loop: within its polls, not when the node goes
            refusing.check()
            time.sleep(0.05)

    import threading

    unpicklable = VerdictHandoff(taker)  # handing fails on this side: the Future would swallow it
    handed(unpicklable, (threading.Lock(), []))
    with pytest.raises(VerdictNotHanded, match="could not be handed to the controller"):
        unpicklable.check()
