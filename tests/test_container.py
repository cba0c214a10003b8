"""The container build's own scripts (container/): the rewrite of an NGC image's pip constraints, and the
kernel smoke check. The image itself is not built here (container/README.md says what was not)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
#: The shape of an NGC PyTorch image's /etc/pip/constraint.txt (names and versions made up).
NGC_CONSTRAINTS = """\
absl-py==2.1.0
numpy==1.26.4
torch==2.10.0a0+b4e4ee81d3
torchvision==0.25.0a0
triton==3.5.0
nvidia-nccl-cu13==2.28.9
transformer_engine==2.9.0
flash_attn==2.7.4.post1
transformers==4.57.0
huggingface-hub==0.35.0
tokenizers==0.22.1
pydantic==2.10.0
"""


def rewrite(tmp_path: Path, torch: str) -> list[str]:
    path = tmp_path / "constraint.txt"
    path.write_text(NGC_CONSTRAINTS)
    subprocess.run(
        [sys.executable, "container/constraints.py", "--torch", torch, "--file", str(path)], cwd=REPO, check=True
    )
    return [line for line in path.read_text().splitlines() if not line.startswith("#")]


def test_base_keeps_the_compiled_stack_pinned_and_frees_the_rest(tmp_path):
    kept = rewrite(tmp_path, "base")
    assert kept == [
        "numpy==1.26.4",
        "torch==2.10.0a0+b4e4ee81d3",
        "torchvision==0.25.0a0",
        "triton==3.5.0",
        "nvidia-nccl-cu13==2.28.9",
        "transformer_engine==2.9.0",
        "flash_attn==2.7.4.post1",
    ]  # transformers, tokenizers, huggingface-hub, pydantic: vlmrun's newer versions may resolve


def test_pins_frees_the_torch_stack_and_names_what_was_built_on_it(tmp_path):
    assert rewrite(tmp_path, "pins") == []
    out = subprocess.run(
        [sys.executable, "container/constraints.py", "--built-on-torch"], cwd=REPO, capture_output=True, text=True
    )
    assert {"transformer-engine", "flash-attn", "apex", "torchvision"} <= set(out.stdout.split())


@pytest.mark.slow  # a process that imports torch
def test_smoke_reports_each_kernel_that_does_not_import():
    out = subprocess.run([sys.executable, "container/smoke.py"], cwd=REPO, capture_output=True, text=True, timeout=120)
    report = json.loads(out.stdout)
    assert set(report["kernels"]) == {"flash_attn", "causal_conv1d", "mamba_ssm"}
    missing = [name for name, row in report["kernels"].items() if not row["ok"]]
    assert out.returncode == (1 if missing else 0) and report["ok"] == (not missing)
    assert all("ModuleNotFoundError" in report["kernels"][name]["error"] for name in missing)  # none here
