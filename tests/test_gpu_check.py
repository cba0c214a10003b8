"""tools/gpu/check.py --cpu-smoke: every section of the GPU check runs on CPU and writes its JSON.

The GPU numbers themselves come from running the script on a GPU machine; this keeps the script from
rotting between those runs (a section that breaks shows up here, with its error in the JSON).
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
SECTIONS = {"cuda", "matmul_ceiling", "fsdp_train", "dcp_resume", "logprob_error"}


@pytest.fixture(scope="module")
def smoke(tmp_path_factory) -> tuple[subprocess.CompletedProcess, dict]:
    """One --cpu-smoke run: (the process, the JSON it wrote to --out)."""
    out = tmp_path_factory.mktemp("gpu-check") / "gpu_check.json"
    env = {k: v for k, v in os.environ.items() if k != "OUT"} | {"CUDA_VISIBLE_DEVICES": ""}
    proc = subprocess.run(
        [sys.executable, "tools/gpu/check.py", "--cpu-smoke", "--out", str(out)],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.exists(), proc.stderr[-3000:]
    return proc, json.loads(out.read_text())


def test_cpu_smoke_runs_every_section_ok(smoke):
    proc, report = smoke
    failed = {name: s.get("error") for name, s in report["sections"].items() if not s["ok"]}
    assert proc.returncode == 0 and report["ok"] and not failed, (failed, proc.stderr[-3000:])
    assert set(report["sections"]) == SECTIONS and report["mode"] == "cpu-smoke"
    assert json.loads(proc.stdout) == report  # the same JSON on stdout


def test_dcp_resume_takes_the_same_next_step(smoke):
    dcp = smoke[1]["sections"]["dcp_resume"]
    assert dcp["determinism"] == "strict" and dcp["loaded_state_equal"]
    assert dcp["next_loss_equal"] and dcp["next_params_equal"] and dcp["next_params_max_abs_diff"] == 0.0
    assert dcp["checkpoint_bytes"] > 0


def test_train_and_logprob_numbers_are_sane(smoke):
    sections = smoke[1]["sections"]
    train, logprob = sections["fsdp_train"], sections["logprob_error"]
    assert all(math.isfinite(x) for x in train["losses"]) and train["tokens_per_s"] > 0
    assert train["flops_per_step"]["total"] > 0 and train["mfu_vs_ceiling"] is not None
    assert train["mfu_vs_spec"] is None and sections["matmul_ceiling"]["spec_tflops"] is None  # no CPU datasheet
    assert sections["cuda"]["all_reduce_ok"] and sections["cuda"]["device_name"] is None
    for key in ("token_mult_prob_error", "token_mult_prob_error_median"):
        assert math.isfinite(logprob[key]) and 1.0 <= logprob[key] < 1.1


def test_a_bad_section_name_is_a_usage_error():
    proc = subprocess.run(
        [sys.executable, "tools/gpu/check.py", "--cpu-smoke", "--sections", "cuda,nope"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2 and "nope" in proc.stderr
