"""Every measurement in tools/ runs and prints the JSON it promises: the tools' lane (`make test-tools`).

Smoke runs: the smallest sizes each tool takes, checked for the keys its docstring promises and for
numbers that are numbers (tools/gpu/check.py: tests/test_gpu_check.py; the user commands bench-loader
and bench-plane: tests/test_data_bench.py, tests/test_bench_plane.py). The numbers themselves are what
the tools are for, on a machine that can measure them. Each test is a work unit of its own under
pytest-xdist (conftest.py), so the lane spreads over the workers.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SPREAD_KEYS = {"median", "min", "max", "q1", "q3", "rounds"}
pytestmark = pytest.mark.tools


def run_tool(*args: str, timeout: int = 240, cwd: Path = ROOT, env: dict | None = None) -> dict:
    """The one JSON object a tool printed on stdout (the process must exit 0)."""
    proc = subprocess.run([sys.executable, *args], cwd=cwd, capture_output=True, text=True, timeout=timeout, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout)


def finite(x) -> bool:
    return isinstance(x, int | float) and math.isfinite(x) and x > 0


@pytest.mark.slow
def test_bench_checkpoint_sharded_against_plain():
    d = run_tool("tools/bench_checkpoint.py", "--mb", "16", "--ranks", "2", "--rounds", "2", "--json")
    assert d["ranks"] == 2 and len(d["sharded_dcp"]["per_rank"]) == 2
    plain, sharded = d["plain_torch_save"], d["sharded_dcp"]
    assert finite(plain["seconds"]) and plain["seconds"] <= plain["seconds_fsync"] and finite(sharded["seconds"])
    assert plain["bytes"] > 16e6 and sharded["bytes"] > 16e6  # parameters and AdamW state, on both sides
    for key in ("sharded_over_plain_rounds", "sharded_over_plain_fsync"):  # the same tensors, in rounds
        assert set(d[key]) == SPREAD_KEYS and d[key]["rounds"] == 2 and finite(d[key]["median"])
    assert d["sharded_over_plain"] == d["sharded_over_plain_rounds"]["median"]
    assert 0 < d["sharded_dcp"]["async_stall_s"] <= d["sharded_dcp"]["async_total_s"]  # the copy, then the files


@pytest.mark.slow
def test_bench_refit_streamed_holds_less_than_a_whole_model_gather():
    d = run_tool(
        "tools/bench_refit.py", "--size", "tiny", "--ranks", "2", "--bucket-mb", "1", "--rounds", "1", "--json"
    )
    streamed, whole = d["streamed"], d["whole"]
    assert d["engine_bytes"] > 0 and finite(streamed["seconds_median"]) and finite(whole["seconds_median"])
    assert 0 < streamed["peak_extra_bytes"] < whole["peak_extra_bytes"]  # a bf16 bucket, not the fp32 model
    assert 0 <= streamed["peak_extra_rss_bytes"] < whole["peak_extra_rss_bytes"]  # every thread, in pages


@pytest.mark.slow
def test_bench_logits_labelled_positions_hold_less_than_the_whole_logits():
    d = run_tool("tools/bench_logits.py", "--rounds", "1", "--json")
    assert d["labelled_tokens"] == 2 * 3 and d["logits_elements"]["labelled"] == d["labelled_tokens"] * d["vocab"]
    assert d["logits_elements"]["whole"] == d["sequences"] * d["seq_len"] * d["vocab"]
    for way in ("loss_peak_bytes", "step_peak_bytes"):
        assert 0 < d[way]["labelled"] < d[way]["whole"]
    for key in ("loss_labelled_over_whole", "step_labelled_over_whole"):
        assert set(d[key]) == SPREAD_KEYS and d[key]["rounds"] == 1 and 0 < d[key]["median"] < 1


@pytest.mark.slow
def test_bench_packing_trains_the_same_loss_from_fewer_fuller_rows():
    d = run_tool("tools/bench_packing.py", "--rounds", "1", "--step-samples", "8", "--pack-tokens", "200")
    assert d["samples"] == 8 and d["padded"]["micro_batches"] == 4  # the recipe's 2 rows each
    assert d["packed"]["micro_batches"] < d["padded"]["micro_batches"]
    assert d["packed"]["padding_fraction"] <= d["padded"]["padding_fraction"]
    assert d["loss_rel_diff"] < 1e-5  # the same samples, the same weights: the same loss
    assert set(d["tokens_per_s_packed_over_padded"]) == SPREAD_KEYS


@pytest.mark.slow
def test_bench_vision_gives_the_tower_one_copy_of_each_prompts_images():
    d = run_tool("tools/bench_vision.py", "--rounds", "1", "--prompts", "2", "--set", "grpo.num_generations=4")
    assert d["num_generations"] == 4 and d["rows_per_micro_batch"] == 2 * 4
    assert d["tower"]["name"] == "tiny" and d["tower"]["hidden_size"] == 32
    assert d["vision_rows_shared_over_repeated"] == {"generate": 0.25, "logprob": 0.25, "train": 0.25}
    for way in ("shared", "repeated"):
        stages = d["stages"][way]
        assert all(stages[s]["s"] > stages[s]["vision_forward_s"] > 0 for s in ("generate", "logprob", "train"))
        assert stages["train"]["vision_backward_s"] > 0
    for key in ("step_shared_over_repeated", "vision_shared_over_repeated"):
        assert set(d[key]) == SPREAD_KEYS and d[key]["rounds"] == 1 and d[key]["median"] > 0


def test_bench_vision_3b_width_is_the_tiny_model_with_the_3b_towers_width(tiny_dirs, tmp_path, monkeypatch):
    """`--tower 3b-width` (the smoke run above takes the tiny tower: the wide one costs 3x its CPU)."""
    from transformers import AutoModelForImageTextToText, AutoProcessor

    monkeypatch.syspath_prepend(str(ROOT / "tools"))
    import bench_vision

    tiny = Path(tiny_dirs["qwen2_5_vl"])
    out = bench_vision.with_tower(tiny, bench_vision.TOWERS["3b-width"], tmp_path / "wide")
    model = AutoModelForImageTextToText.from_pretrained(out)
    vision, text = model.config.vision_config, model.config.text_config
    assert (vision.hidden_size, vision.intermediate_size, vision.num_heads) == (1280, 3420, 16)
    assert vision.depth == 2 and vision.out_hidden_size == text.hidden_size == 128  # the tiny text model
    assert (
        AutoProcessor.from_pretrained(out).tokenizer.get_vocab()
        == AutoProcessor.from_pretrained(tiny).tokenizer.get_vocab()
    )


@pytest.mark.slow
def test_measure_memory_grpo_phases_against_their_estimates():
    d = run_tool("tools/measure_memory.py", "--recipe", "recipes/tiny-grpo-cpu.yaml", "--family", "qwen2_5_vl")
    (row,) = d["families"]
    assert set(row["phases"]) == {"refit", "generation", "training"}
    assert all(p["measured_bytes"] > 0 and finite(p["ratio"]) for p in row["phases"].values())
    assert row["measured_peak_bytes"] == max(p["measured_bytes"] for p in row["phases"].values())
    assert 0.5 < row["ratio_estimate_to_measured"] < 2  # the estimate and the measurement describe one step


@pytest.mark.slow
def test_measure_memory_estimate_against_the_measured_step():
    d = run_tool("tools/measure_memory.py", "--family", "qwen2_5_vl")
    (row,) = d["families"]
    assert row["family"] == "qwen2_5_vl" and row["measured_peak_bytes"] > row["alive_before_step_bytes"] > 0
    assert 0.5 < row["ratio_estimate_to_measured"] < 2  # the estimate and the measurement describe one step


@pytest.mark.slow
def test_gpu_policy_check_on_the_cpu(tiny_dirs, tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "OUT"} | {"CUDA_VISIBLE_DEVICES": ""}
    d = run_tool(
        "tools/gpu/policy_check.py", "--model-dir", tiny_dirs["qwen2_5_vl"], "--out", str(tmp_path / "p.json"), env=env
    )
    assert d["ok"] and d["device"] == "cpu" and d["next_step_equal"] and d["loss_falls"]
    assert json.loads((tmp_path / "p.json").read_text()) == d
    assert d["validation"]["tokens"] > 0 and d["validation"]["answered"] == 1


@pytest.mark.slow
def test_measure_generation_three_ways_in_rounds(tmp_path):
    d = run_tool(
        "tools/measure_generation.py",
        *("--prompts", "2", "--n", "2", "--max-new-tokens", "4", "--repeats", "2", "--work", str(tmp_path)),
    )
    assert [r["where"] for r in d["rows"]] == ["bare generate", "HfGenerator in process", "HfGenerator in a Ray actor"]
    assert all(finite(r["tokens_per_s"]) for r in d["rows"]) and finite(d["rows"][2]["round_trip_tokens_per_s"])
    for key in ("in_process_over_bare", "actor_over_bare", "actor_round_trip_over_bare"):
        assert set(d[key]) == SPREAD_KEYS and d[key]["rounds"] == 2 and finite(d[key]["median"])


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_measure_grpo_one_plane(tmp_path, run_data):
    # one replica: the tool's sections run the same (the plane's bytes, the generation rows); ~2 ranks' start saved
    small = ["train.global_batch_size=8", "grpo.num_generations=4", "train.val_samples=0", "parallel.dp=1"]
    d = run_tool(
        "tools/measure_grpo.py",
        *("--steps", "2", "--repeats", "1", "--planes", "local", "--work", str(tmp_path)),
        *run_data,  # the session's CLEVR set (--set pairs, as the tool takes them), not the recipe's 2048 images
        *(arg for item in small for arg in ("--set", item)),
        timeout=580,
    )
    assert set(d["planes"]) == {"local"} and d["identical_losses"]
    row = d["planes"]["local"]
    assert finite(row["step_time_s"]) and 0 <= row["data_plane_fraction"] < 1 and row["plane_bytes_per_step"] > 0
    assert d["plane_bytes_per_step"]["bfloat16_pixels"] < d["plane_bytes_per_step"]["float32_pixels"]
    assert finite(d["generation"]["bare"]["tokens_per_s"]) and finite(d["generation"]["in_loop_over_bare"])


@pytest.mark.slow
def test_bench_load_sharded_against_the_whole_load():
    # one rank: each variant's ranks start fresh (3 x ranks processes); a rank's own rows: test_sharded_load.py
    d = run_tool("tools/bench_load.py", "--size", "tiny", "--ranks", "1", "--rounds", "1", "--json")
    sharded, whole = d["sharded"], d["whole"]
    assert d["params"] > 0 and d["model_bytes"] == 4 * d["params"] and d["disk_dtype"] == "bfloat16"
    assert sharded["load"] == "each rank read only its own rows of the weights' files"
    assert whole["load"].startswith("whole on every rank")  # the product's fallback, forced
    assert finite(sharded["seconds_median"]) and finite(whole["seconds_median"]) and sharded["peak_extra_bytes_max"] > 0
    assert set(d["sharded_over_whole_s"]) == SPREAD_KEYS and d["sharded_over_whole_s"]["rounds"] == 1
    resume = d["resume"]  # the policy's start from a checkpoint: nothing of the directory read
    assert resume["load"] == "from the checkpoint it resumed (the model's own weights not read)"
    assert resume["checkpoint_bytes"] > 3 * d["model_bytes"] and finite(resume["verify_s"][0])  # model + AdamW
    assert set(d["resume_over_cold_s"]) == SPREAD_KEYS


@pytest.mark.slow
def test_bench_resume_times_a_resumes_first_step_against_a_cold_starts():
    d = run_tool("tools/bench_resume.py", "--size", "tiny", "--ranks", "1", "--rounds", "1", "--json", timeout=400)
    assert d["rounds"] == 1 and d["ranks"] == 1 and d["checkpoint_bytes"] > d["weights_bytes_bf16"] > 0
    assert d["cold"]["policy_load"] == "each rank read only its own rows of the weights' files"
    assert d["resume"]["policy_load"] == "from the checkpoint it resumed (the model's own weights not read)"
    assert all(finite(s) for side in ("cold", "resume") for s in d[side]["first_step_s"])
    assert set(d["resume_over_cold_first_step"]) == SPREAD_KEYS and finite(d["resume_over_cold_first_step"]["median"])


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_measure_rank_memory_reads_each_rank_s_peak_from_outside(tmp_path):
    d = run_tool(
        "tools/measure_rank_memory.py",
        *("--hidden", "128", "--layers", "2", "--intermediate", "256", "--work", str(tmp_path)),
        timeout=600,
    )
    assert d["model_params"] > 0 and d["model_fp32_mb"] > 0
    for run in ("tiny", "large"):  # two ranks each (their loader workers left out), one step row
        assert len(d[run]["ranks_vmhwm_mb"]) == 2 and all(finite(x) for x in d[run]["ranks_vmhwm_mb"])
        assert len(d[run]["rows_peak_rss_mb"]) == 1 and finite(d[run]["rows_peak_rss_mb"][0])
        assert d[run]["rows_peak_rss_mb"][0] <= max(d[run]["ranks_vmhwm_mb"]) + 1  # the step's, within the life's
    assert len(d["ratio_to_fp32_model"]) == 2


@pytest.mark.slow
def test_bench_megatron_tp2_against_hf_dp2_in_rounds():
    d = run_tool(
        "tools/bench_megatron.py", "--rounds", "1", "--steps", "1", "--micro-batches", "2", "--json", timeout=600
    )
    assert d["rounds"] == 1 and d["tokens_per_step"] > 0
    assert finite(d["hf_dp2"]["tokens_per_s_median"]) and finite(d["megatron_tp2"]["tokens_per_s_median"])
    assert (
        set(d["megatron_over_hf_rounds"]) == SPREAD_KEYS
        and d["megatron_over_hf"] == d["megatron_over_hf_rounds"]["median"]
    )
    assert d["megatron_tp2"]["first_loss"] == pytest.approx(
        d["hf_dp2"]["first_loss"], rel=1e-5
    )  # same model, same data
