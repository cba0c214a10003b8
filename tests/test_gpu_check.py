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


def test_the_multi_gpu_check_answers_help_without_a_gpu():
    proc = subprocess.run(
        [sys.executable, "-c", WITHOUT_ABSENT, "tools/gpu/multi_gpu_check.py", "--help"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0 and "--time-limit" in proc.stdout and "hsdp" in proc.stdout


@pytest.mark.slow  # 2 gloo ranks per layout, FSDP2 and HSDP, a DCP round trip each: ~30 s
def test_the_multi_gpu_check_runs_its_cases_on_two_cpu_ranks(tmp_path):
    out = tmp_path / "multi.json"
    env = {k: v for k, v in os.environ.items() if k != "OUT"} | {"CUDA_VISIBLE_DEVICES": "", "PYTHONPATH": str(REPO)}
    proc = subprocess.run(
        [sys.executable, "tools/gpu/multi_gpu_check.py", "--cpu-smoke", "--steps", "2", "--out", str(out)],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    report = json.loads(out.read_text())
    assert proc.returncode == 0 and report["ok"], (report, proc.stderr[-3000:])
    assert set(report["cases"]) == {"tiny-fsdp", "tiny-hsdp"}
    fsdp, hsdp = report["cases"]["tiny-fsdp"], report["cases"]["tiny-hsdp"]
    assert fsdp["policy_layout"] == "FSDP2 over 2 ranks" and hsdp["policy_layout"].startswith("HSDP: 2 replicas")
    for case in (fsdp, hsdp):  # rank 0's second micro-batch was text-only: the step went through
        assert case["dcp_equal"] and case["ranks_agree"] and len(case["losses"]) == 2
        assert case["tokens_per_s_per_gpu"] > 0 and case["mfu_vs_ceiling"] > 0


@pytest.mark.slow  # an hf engine and a policy of the tiny model, 4 prompts x 2 responses
def test_the_vllm_check_s_prompts_of_mixed_image_sizes_score_as_they_were_sampled(tiny_dirs):
    """Its prompts are left-padded as the product pads prompts (the tiny tokenizer pads on the right, and
    with images of different sizes generation went on after the pads): the hf policy's log-probs of what
    the hf engine sampled are the engine's own, to fp32 round-off."""
    import importlib.util

    from vlmrun.generation import open_generator
    from vlmrun.generation.interface import SamplingParams
    from vlmrun.models.spec import ModelSpec
    from vlmrun.policy import open_policy

    spec = importlib.util.spec_from_file_location("vllm_check", REPO / "tools" / "gpu" / "vllm_check.py")
    check = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(check)
    model_dir = tiny_dirs["qwen2_5_vl"]
    batch = check.prompts(model_dir, 4, 112)
    assert batch.media["image_grid_thw"][:, 1].tolist() == [8, 6, 8, 6]  # two sizes, two prompt lengths
    assert (batch.attention_mask[:, -1] == 1).all() and (batch.attention_mask[:, 0] == 0).any()  # padded left
    engine = open_generator("hf", model=ModelSpec(directory=model_dir))
    engine.setup()
    sys.path.insert(0, str(REPO / "tools" / "gpu"))
    from workload import TRAIN

    policy = open_policy("hf", model=ModelSpec(directory=model_dir), rank=0, world_size=1, train=TRAIN)
    policy.setup(master_addr="127.0.0.1", master_port=0, max_steps=1)
    rollouts = engine.generate(batch, SamplingParams(temperature=1.0, max_new_tokens=6, seed=3), n=2)
    error = check.prob_error(policy, rollouts)
    assert 1.0 <= error["max"] < 1.0001, error
