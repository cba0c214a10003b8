"""tools/gpu/check.py --cpu-smoke: every section of the GPU check runs on CPU and writes its JSON.

The GPU numbers themselves come from running the script on a GPU machine; this keeps the script from
rotting between those runs (a section that breaks shows up here, with its error in the JSON). The run
hides every package the GPU machine lacks (it has torch, transformers and their dependencies only), so
an import of pydantic, Ray or the data stack on the check's path fails here first.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

REPO = Path(__file__).resolve().parents[1]
SECTIONS = {"cuda", "matmul_ceiling", "fsdp_train", "dcp_resume", "logprob_error", "memory_fit"}
#: vlmrun's dependencies that the lent GPU machine does not have (FACTS.md: Python 3.12, torch 2.11,
#: transformers 5.17, no Ray, no package registry).
ABSENT_ON_GPU_MACHINE = (
    "pydantic", "typer", "rich", "click", "ray", "megatron", "webdataset", "submitit", "wandb",
    "matplotlib", "psutil", "transferqueue", "mooncake", "PIL", "torchvision",
)  # fmt: skip
# Runs the script as `python tools/gpu/check.py` would (its folder first on sys.path), with those
# packages hidden: an import of one raises ImportError, and importlib.util.find_spec reports it absent.
WITHOUT_ABSENT = (
    "import runpy, sys\n"
    f"sys.modules.update(dict.fromkeys({ABSENT_ON_GPU_MACHINE!r}))\n"
    "sys.argv = sys.argv[1:]\n"
    "sys.path.insert(0, 'tools/gpu')\n"
    "runpy.run_path(sys.argv[0], run_name='__main__')\n"
)


@pytest.fixture(scope="module")
def smoke(tmp_path_factory) -> tuple[subprocess.CompletedProcess, dict]:
    """One --cpu-smoke run: (the process, the JSON it wrote to --out)."""
    out = tmp_path_factory.mktemp("gpu-check") / "gpu_check.json"
    env = {k: v for k, v in os.environ.items() if k != "OUT"} | {"CUDA_VISIBLE_DEVICES": ""}
    proc = subprocess.run(
        [sys.executable, "-c", WITHOUT_ABSENT, "tools/gpu/check.py", "--cpu-smoke", "--out", str(out)],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.exists(), proc.stderr[-3000:]
    return proc, json.loads(out.read_text())


@pytest.mark.slow  # the smoke run: ~25 s
def test_cpu_smoke_runs_every_section_ok(smoke):
    proc, report = smoke
    failed = {name: s.get("error") for name, s in report["sections"].items() if not s["ok"]}
    assert proc.returncode == 0 and report["ok"] and not failed, (failed, proc.stderr[-3000:])
    assert set(report["sections"]) == SECTIONS and report["mode"] == "cpu-smoke"
    assert json.loads(proc.stdout) == report  # the same JSON on stdout


@pytest.mark.slow  # the smoke run: ~25 s
def test_the_check_imports_nothing_the_gpu_machine_lacks(smoke):
    proc, report = smoke
    assert report["ok"], proc.stderr[-3000:]  # the run above had every absent package hidden
    assert "ImportError" not in proc.stderr and "ModuleNotFoundError" not in proc.stderr


@pytest.mark.slow  # the smoke run: ~25 s
def test_dcp_resume_takes_the_same_next_step(smoke):
    dcp = smoke[1]["sections"]["dcp_resume"]
    assert dcp["determinism"] == "strict" and dcp["loaded_state_equal"]
    assert dcp["next_loss_equal"] and dcp["next_params_equal"] and dcp["next_params_max_abs_diff"] == 0.0
    assert dcp["next_grad_norm_equal"] and dcp["checkpoint_bytes"] > 0
    assert dcp["checkpoint_files"] >= 3  # the store's manifest and controller part, the policy's DCP shard


@pytest.mark.slow  # the smoke run: ~25 s
def test_training_goes_through_the_policy_step(smoke):
    train = smoke[1]["sections"]["fsdp_train"]
    assert list(train["phases_s"]) == ["forward_backward", "grad_norm_clip", "optimizer"]  # the policy's phases
    assert 0 < train["valid_tokens_per_step"] < train["tokens_per_step"]  # the NLL skips the image tokens
    assert train["losses"][-1] < train["losses"][0]  # the same batch, step after step


@pytest.mark.slow  # the smoke run: ~25 s
def test_train_and_logprob_numbers_are_sane(smoke):
    sections = smoke[1]["sections"]
    train, logprob = sections["fsdp_train"], sections["logprob_error"]
    assert all(math.isfinite(x) for x in train["losses"]) and train["tokens_per_s"] > 0
    assert train["flops_per_step"]["total"] > 0 and train["mfu_vs_ceiling"] is not None
    assert train["mfu_vs_spec"] is None and sections["matmul_ceiling"]["spec_tflops"] is None  # no CPU datasheet
    assert sections["cuda"]["all_reduce_ok"] and sections["cuda"]["device_name"] is None
    for key in ("token_mult_prob_error", "token_mult_prob_error_median"):
        assert math.isfinite(logprob[key]) and 1.0 <= logprob[key] < 1.1
    (memory,) = sections["memory_fit"]["rows"]  # one tiny case on CPU: estimated, stepped, no CUDA peak
    assert (
        memory["estimate_without_overhead"] > 0 and math.isfinite(memory["loss"]) and memory["allocated_peak"] is None
    )


def test_a_bad_section_name_is_a_usage_error():
    proc = subprocess.run(
        [sys.executable, "tools/gpu/check.py", "--cpu-smoke", "--sections", "cuda,nope"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2 and "nope" in proc.stderr
