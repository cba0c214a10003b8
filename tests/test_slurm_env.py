"""The SLURM task environment and the Ray port blocks, without a cluster (mock.patch.dict(os.environ))."""

from __future__ import annotations

import os
import socket
from pathlib import Path
from unittest import mock

import pytest

from vlmrun.cluster import slurm_env
from vlmrun.cluster.ray import allocation as ray_slurm
from vlmrun.cluster.ray.nodes import (
    BLOCK_SIZE,
    PORT_BASE,
    PORT_END,
    PortBlock,
    job_temp_dir,
    n_blocks,
    node_resource,
    port_block,
    ray_env,
    taken_ports,
)
from vlmrun.cluster.slurm_env import SlurmAllocation

TASK = {
    "SLURM_JOB_ID": "1234",
    "SLURM_NODEID": "1",
    "SLURM_PROCID": "1",
    "SLURM_JOB_NUM_NODES": "2",
    "SLURMD_NODENAME": "n2",
    "SLURM_JOB_NODELIST": "n[1-2]",
    "SLURM_RESTART_COUNT": "2",
    "SLURM_CPUS_ON_NODE": "16",
    "CUDA_VISIBLE_DEVICES": "0,1,2,3",
}


def test_allocation_from_env():
    with mock.patch.dict(os.environ, TASK, clear=True):
        a = SlurmAllocation.from_env()
    assert a == SlurmAllocation(
        job_id="1234",
        node_rank=1,
        num_nodes=2,
        nodename="n2",
        nodelist="n[1-2]",
        restart_count=2,
        cpus_on_node=16,
        gpus_on_node=4,
    )
    assert a.rendezvous(Path("/r")) == Path("/r/1234.2")


def test_outside_a_task_there_is_no_allocation():
    with mock.patch.dict(os.environ, {}, clear=True):
        assert SlurmAllocation.from_env() is None
    with mock.patch.dict(os.environ, {"SLURM_JOB_ID": "5"}, clear=True):  # the batch shell, not a task
        assert SlurmAllocation.from_env() is None


def test_array_task_and_defaults():
    env = {"SLURM_JOB_ID": "101", "SLURM_ARRAY_JOB_ID": "100", "SLURM_ARRAY_TASK_ID": "1", "SLURM_NODEID": "0"}
    with mock.patch.dict(os.environ, env, clear=True):
        a = SlurmAllocation.from_env()
    assert a.job_id == "100_1" and a.num_nodes == 1 and a.restart_count == 0 and a.gpus_on_node == 0
    assert a.nodename == socket.gethostname() and a.hostnames() == [a.nodename]


@pytest.mark.parametrize(
    "env,gpus",
    [
        ({"CUDA_VISIBLE_DEVICES": ""}, 0),
        ({"CUDA_VISIBLE_DEVICES": "-1"}, 0),
        ({"SLURM_GPUS_ON_NODE": "8"}, 8),
        ({"CUDA_VISIBLE_DEVICES": "3"}, 1),
    ],
)
def test_visible_gpus(env, gpus):
    assert slurm_env._visible_gpus(env) == gpus


def test_port_blocks_are_distinct_for_neighbouring_jobs_and_in_range():
    bases = [port_block(str(j)).base for j in range(1000, 1000 + n_blocks())]
    assert len(set(bases)) == n_blocks()
    for base in bases:
        assert PORT_BASE <= base and base + BLOCK_SIZE <= PORT_END and (base - PORT_BASE) % BLOCK_SIZE == 0
    assert port_block("1000_3") != port_block("1000_4")  # array tasks of one job differ too


def test_every_ray_port_is_explicit_and_inside_the_block():
    block = PortBlock(PORT_BASE + 5 * BLOCK_SIZE)
    args = block.start_args(head=True)
    ports = [int(a.split("=")[1]) for a in args if a.partition("=")[2].isdigit()]
    assert len(ports) == len(set(ports)) == 9  # 7 fixed + worker min/max
    assert all(block.base <= p < block.base + BLOCK_SIZE for p in ports)
    assert {"--include-dashboard=false", "--no-monitor"} <= set(args)
    assert not any(
        a.startswith(("--port=", "--include-dashboard", "--no-monitor")) for a in block.start_args(head=False)
    )
    assert set(block.fixed_ports(head=False)) < set(block.fixed_ports(head=True))
    assert max(block.fixed_ports(head=True)) < block.worker_ports.start


def test_taken_ports_are_found():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        assert taken_ports("127.0.0.1", [port]) == [port]
    assert taken_ports("127.0.0.1", [port]) == []


def test_ray_env_is_private_and_keeps_loopback():
    assert ray_env("127.0.0.1") == {
        "RAY_AUTH_MODE": "disabled",
        "RAY_USAGE_STATS_ENABLED": "0",
        "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",
        "GLOO_SOCKET_IFNAME": "lo",
        "__RAY_WORKER_PROCESS_SETUP_HOOK_ENV_VAR": "vlmrun.startup.pause_in_worker",
    }
    env = ray_env("192.0.2.1")  # an address no interface here holds (TEST-NET-1)
    assert env["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] == "1" and "GLOO_SOCKET_IFNAME" not in env


def test_temp_dir_is_short_and_per_job_and_node(monkeypatch):
    monkeypatch.setenv("TMPDIR", "/very/long/scheduler/provided/tmp/dir/job/1234/x")
    p = job_temp_dir("1234", "n2")
    assert str(p) == "/tmp/vlmrun-ray-1234-n2" and job_temp_dir("1235", "n2") != p
    assert node_resource("gpu-node.7") == "vlmrun_node_gpu_node_7"


def test_node_address_prefers_nodeaddr_and_never_resolves_outward():
    with mock.patch.object(slurm_env.subprocess, "run") as run:
        run.return_value.stdout = "NodeName=n1 Arch=x86_64\n   NodeAddr=10.200.0.11 NodeHostName=vm Version=22.05\n"
        assert slurm_env.node_address("n1") == "10.200.0.11"
        run.return_value.stdout = "NodeName=vm\n   NodeAddr=127.0.0.1 NodeHostName=vm\n"
        assert slurm_env.node_address("vm") == "127.0.0.1"


def test_several_nodes_on_loopback_are_refused():
    a = SlurmAllocation(job_id="9", node_rank=0, num_nodes=2, nodename="n1", nodelist="n[1-2]")
    with (
        mock.patch.object(ray_slurm, "node_address", return_value="127.0.0.1"),
        pytest.raises(ray_slurm.RayBringUpError) as e,
    ):
        ray_slurm._checked_address(a, 2)
    assert "SLURM_NETNS=1" in str(e.value)


def test_missing_nodes_are_named(tmp_path):
    (tmp_path / "worker-n3.json").write_text('{"state": "started"}')
    found = {"n1": {"Resources": {"CPU": 2.0}}, "n2": {"Resources": {"CPU": 1.0}}}
    msg = ray_slurm._missing_message(["n1", "n2", "n3", "n4"], found, {"n2": found["n2"]}, tmp_path, 2, 0, 30)
    assert "3 of 4 node(s) missing [n2, n3, n4]" in msg
    assert "n2 joined with CPU=1 GPU=0, expected CPU=2 GPU=0" in msg
    assert (
        "n3 did not join (last said: started)" in msg and "n4 did not join (its node entrypoint never reported)" in msg
    )
