"""The `vllm` backend's refit naming against vLLM's own model classes (vlmrun/generation/vllm_weights.py):
every tensor the policy sends (`weights_for_refit`, by transformers' in-memory names) fills exactly one
parameter of vLLM's class of the family, every parameter of that class is filled, and a tensor whose
parameter vLLM does not fuse arrives equal. vLLM's classes come from .vllm-classes/ (`make
vllm-classes`: vllm 0.26.0 beside the project's torch, requirements/vllm-classes.txt says why), in one
process of their own for all the families. Without that folder the test skips, except in CI, where it must run.

Nemotron-Omni is not checked yet: vLLM 0.26 names its class NemotronH_Nano_Omni_Reasoning_V3 (the
published checkpoints' architecture), transformers 5.24 saves the tiny model as
NemotronH_Omni_Reasoning_V3, so the engine would need the architecture overridden first.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from vlmrun_cli import ROOT

pytestmark = pytest.mark.slow

CLASSES = ROOT / ".vllm-classes"


@pytest.fixture(scope="module")
def probed(tiny_dirs) -> dict[str, dict]:
    """family -> what the probe found for its tiny model (one process for all the families)."""
    if not (CLASSES / "vllm").is_dir():
        if os.environ.get("CI"):
            pytest.fail(f"{CLASSES} is missing: .ci/run installs it (make vllm-classes)")
        pytest.skip(f"vLLM's classes are not installed ({CLASSES}): make vllm-classes")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(CLASSES), str(ROOT), str(ROOT / "tests")]))
    dirs = {tiny_dirs[family]: family for family in VLLM_CLASSES}
    out = subprocess.run(
        [sys.executable, str(ROOT / "tests" / "vllm_classes_probe.py"), *dirs],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    found = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
    return {dirs[d["model_dir"]]: d for d in found}


#: family -> the architecture vLLM reads from its tiny model's config.json
VLLM_CLASSES = {
    "qwen2_vl": "Qwen2VLForConditionalGeneration",
    "qwen2_5_vl": "Qwen2_5_VLForConditionalGeneration",
    "qwen3_vl": "Qwen3VLForConditionalGeneration",
}


@pytest.mark.parametrize("family", VLLM_CLASSES)
def test_every_policy_tensor_fills_exactly_one_parameter_of_vllms_class(probed, family):
    d = probed[family]
    assert d["vllm"] == "0.26.0" and d["architecture"] == VLLM_CLASSES[family]
    assert all(len(t) == 1 for t in d["targets"].values()), {n: t for n, t in d["targets"].items() if len(t) != 1}
    assert set(d["filled"]) == {p for t in d["targets"].values() for p in t} and len(d["filled"]) == d["engine_params"]
    assert d["engine_params"] < d["policy_tensors"]  # vLLM fuses q, k, v and gate, up into one parameter each
    assert d["unfused_equal"] and d["unfused"] > 0 and d["buckets"] > 1  # the bucketed refit, tensor for tensor


def test_the_backend_builds_vllms_sampling_params_and_reads_its_outputs(probed):
    """vLLM's own SamplingParams from the vllm backend's options (seeded, raw log-probs of the drawn
    token, stop at end of turn, placeholders never drawn, greedy without a seed), and its own
    RequestOutput / CompletionOutput / Logprob read back into rollouts (vlmrun/generation/vllm.py)."""
    got = probed["qwen2_vl"]["backend"]
    seed, temperature, top_p, logprobs, max_tokens = got["sampled"]
    assert seed > 0 and (temperature, top_p, logprobs, max_tokens) == (0.7, 0.9, 0, 3)
    assert got["stop_token_ids"] == got["eos"] and got["greedy_temperature"] == 0.0
    assert got["logit_bias"] == got["never_generated"] and got["never_generated"]
    eos, pad = got["eos"][0], got["pad"]
    assert got["response_ids"] == [[11, eos, pad], [13, 14, 15]]
    assert got["response_mask"] == [[1, 1, 0], [1, 1, 1]]
    assert got["logprobs"] == [[-0.5, -1.0, 0.0], [-0.5, -1.0, -1.5]]
