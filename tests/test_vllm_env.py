"""Where the `vllm` backend may run, and what it needs there: its engine's own environment (found from
the recipe, $VLMRUN_VLLM_ENV or the checkout, checked from files at submit), one vLLM line pinned the
same way for CPU and GPU, the shared segment a refit crosses the process boundary through, the recipes
that accept it (every shipped GRPO layout of a family it runs: no torch reason left), and the memory
check's count of the engine's process."""

from __future__ import annotations

import json
import platform
import re
import tomllib
from pathlib import Path

import pytest
import torch
from vlmrun_cli import GRPO, ROOT, refused, vlmrun

from vlmrun.config.load import load_recipe
from vlmrun.errors import InputError
from vlmrun.generation import vllm_env
from vlmrun.generation.vllm_env import ENV_VAR, MARKER, engine_environment, environment_path
from vlmrun.generation.vllm_wire import EngineSegments, HostSegment
from vlmrun.models.fit import check_memory_fit, device_bytes
from vlmrun.models.memory import ENGINE_PROCESS_OVERHEAD

GPU_GRPO = "recipes/qwen2.5-vl-3b-clevr-grpo-1n2g.yaml"
OMNI_GRPO = "recipes/omni-clevr-grpo-1n8g.yaml"


def built(folder: Path, **versions) -> Path:
    """A folder that looks like a built engine environment (its marker and interpreter)."""
    (folder / "bin").mkdir(parents=True)
    (folder / "bin" / "python").touch()
    marker = {"kind": "cpu", "python": platform.python_version(), "vllm": "0.32.0", **versions}
    (folder / MARKER).write_text(json.dumps(marker))
    return folder


def test_the_environment_is_the_recipes_else_the_variables_else_the_checkouts_by_kind(tmp_path):
    assert environment_path(str(tmp_path / "a"), on_gpu=False, environ={ENV_VAR: "/b"}) == tmp_path / "a"
    assert environment_path(None, on_gpu=True, environ={ENV_VAR: "/b"}) == Path("/b")
    assert environment_path(None, on_gpu=False, environ={}) == ROOT / ".vllm-cpu"
    assert environment_path(None, on_gpu=True, environ={}) == ROOT / ".vllm"


@pytest.mark.parametrize(
    "make, words",
    [
        (lambda f: f, "does not exist"),
        (lambda f: f.mkdir() or f, f"holds no built engine environment (no {MARKER})"),
        (lambda f: built(f, python="3.10.1"), "was built with Python 3.10.1"),
        (lambda f: built(f, vllm="0.26.0"), "holds vLLM 0.26.0; the engine runs vLLM 0.32.x"),
        (lambda f: built(f, kind="gpu"), "is a gpu build; a CPU run needs a cpu one"),
    ],
)
def test_an_environment_that_cannot_run_the_engine_is_refused_naming_how_to_build_one(tmp_path, make, words):
    folder = make(tmp_path / "env")
    with pytest.raises(InputError) as e:
        engine_environment(str(folder), on_gpu=False)
    assert e.value.field == "generation.backend" and words in str(e.value)
    assert "make vllm-cpu" in str(e.value) and "generation.backend: hf" in str(e.value)
    env = engine_environment(str(built(tmp_path / "good")), on_gpu=False)
    assert env.python == tmp_path / "good" / "bin" / "python" and env.versions["vllm"] == "0.32.0"


def test_a_run_without_its_engine_environment_is_refused_at_submit(tmp_path):
    run = tmp_path / "run"
    args = ["--cluster", "local", "--run-dir", str(run), "--set", "generation.backend=vllm"]
    out = vlmrun("submit", GRPO, *args, cwd=tmp_path, env={ENV_VAR: str(tmp_path / "no-env")})
    err = refused(out, "generation.backend", "make vllm-cpu", str(tmp_path / "no-env"))
    assert "does not exist" in err and not run.exists()


def test_one_vllm_line_for_cpu_and_gpu_pinned_with_the_projects_ray_and_transformers():
    def pins(name: str) -> dict[str, str]:
        lines = (ROOT / "requirements" / name).read_text().splitlines()
        found = (re.match(r"^([\w\-\[\]]+)==(\S+)$", line) for line in lines)
        return {m[1].split("[")[0].lower(): m[2] for m in found if m}

    tested, cpu, gpu = pins("tested.txt"), pins("vllm-cpu.txt"), pins("vllm-gpu.txt")
    assert cpu["vllm-cpu"] == gpu["vllm"] and cpu["vllm-cpu"].startswith(vllm_env.SUPPORTED_LINE)
    assert cpu["ray"] == gpu["ray"] == tested["ray"]  # the engine is a Ray actor of the project's Ray
    assert pins("vllm-overrides.txt")["transformers"] == tested["transformers"]
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert extras["vllm"] == [f"vllm=={gpu['vllm']}"] and extras["vllm-cpu"] == [f"vllm-cpu=={cpu['vllm-cpu']}"]


def test_a_bucket_crosses_through_shared_memory_the_engine_maps_and_leaves_no_file():
    """vllm_wire.py: the rank copies a bucket into a /dev/shm file, the engine maps the same pages (a
    second mapping here) and reads the tensors back as they were; the file goes once it is mapped."""
    segment, engine = HostSegment(), EngineSegments()
    first = {"w": torch.randn(3, 5), "b": torch.randn(7, dtype=torch.float64).to(torch.bfloat16), "n": torch.arange(3)}
    message = segment.put(first)
    got = dict(engine.tensors(message))
    assert list(got) == list(first) and all(torch.equal(got[k], first[k]) for k in first)
    assert all(s.offset % 256 == 0 for s in message.slots) and Path(message.path).exists()
    segment.mapped()
    assert not Path(message.path).exists()
    second = {"w": torch.ones(2, 2)}
    again = segment.put(second)  # smaller: the same pages, rewritten
    assert again.path == message.path and torch.equal(dict(engine.tensors(again))["w"], second["w"])
    larger = segment.put({"big": torch.zeros(10_000)})
    assert larger.path != message.path and Path(larger.path).exists()
    segment.close()
    engine.close()
    assert not Path(larger.path).exists()


# ---------------------------------------------------------------- recipes and the memory check


def test_every_shipped_grpo_layout_accepts_vllm_where_its_family_runs():
    """The engine runs in a process of its own, on vLLM's torch: no layout is refused for torch's sake
    (FSDP2 over several ranks keeps the project's torch). Nemotron-Omni is refused for its model."""
    for recipe in ("recipes/tiny-grpo-cpu.yaml", GPU_GRPO):
        assert load_recipe(recipe, ["generation.backend=vllm"]).generation.backend == "vllm"
    fsdp = load_recipe(GPU_GRPO, ["generation.backend=vllm", "parallel.fsdp=true"])
    assert fsdp.parallel.sharded and check_memory_fit(fsdp).estimate.engine_budget > 0
    with pytest.raises(InputError) as omni:
        load_recipe(OMNI_GRPO, ["generation.backend=vllm"])
    assert "nemotron_omni" in str(omni.value) and "torch" not in str(omni.value)


@pytest.mark.parametrize(
    "recipe, sets, field, words",
    [
        (OMNI_GRPO, ["generation.backend=vllm"], "generation.backend", "tensor parallel"),
        ("recipes/qwen2.5-vl-3b-clevr-1n2g.yaml", ["generation.backend=vllm"], "generation.backend", "GRPO's rollouts"),
        (GPU_GRPO, ["generation.vllm={enforce_eager: true}"], "generation.vllm", "generation.backend: vllm"),
        (
            GPU_GRPO,
            ["generation.backend=vllm", "generation.vllm={max_model_len: 512}"],
            "generation.vllm.max_model_len",
            "data.max_seq_len + grpo.max_new_tokens = 528",
        ),
        (
            GPU_GRPO,
            ["generation.backend=vllm", "generation.vllm={gpu_memory_utilization: 1.5}"],
            "generation.vllm.gpu_memory_utilization",
            "less than or equal to 1",
        ),
        (
            GPU_GRPO,
            ["generation.backend=vllm", "generation.vllm={kv_cache_memory_bytes: 1073741824}"],
            "generation.vllm.kv_cache_memory_bytes",
            "applies to a CPU run",
        ),
    ],
)
def test_a_recipe_vllm_cannot_run_is_refused_at_load(recipe, sets, field, words):
    with pytest.raises(InputError) as e:
        load_recipe(recipe, sets)
    assert str(e.value).startswith(field) and words in str(e.value)


def test_the_engine_options_come_from_the_recipe():
    recipe = load_recipe(
        GPU_GRPO, ["generation.backend=vllm", "generation.vllm={enforce_eager: true, env: /opt/engine}"]
    )
    assert recipe.generation.engine_options(max_model_len=528) == {
        "engine": {
            "gpu_memory_utilization": 0.5,
            "max_model_len": 528,
            "enforce_eager": True,
            "enable_prefix_caching": True,
        },
        "env": "/opt/engine",
        "end_on_release": True,  # the recipe's generation.release_weights
    }
    assert load_recipe(GPU_GRPO).generation.engine_options(max_model_len=528) == {}


def test_the_memory_check_counts_the_engines_process_and_its_share_while_it_generates():
    hf = check_memory_fit(load_recipe(GPU_GRPO)).estimate
    e = check_memory_fit(load_recipe(GPU_GRPO, ["generation.backend=vllm"])).estimate
    assert e.engine_budget == int(0.5 * device_bytes(80)) and not e.engine_resident
    assert e.phase_terms()["generation"] == {
        "generation engine": e.engine_weights,
        "generation": e.engine_budget - e.engine_weights,
    }
    for phase in e.phase_terms():  # its own CUDA context, asleep or not
        assert e.resident_terms(phase)["engine process"] == ENGINE_PROCESS_OVERHEAD
    assert e.phase_total("generation") == sum(e.resident_terms("generation").values()) + e.engine_budget + e.overhead
    for phase in ("forward", "backward"):
        assert e.phase_total(phase) == hf.phase_total(phase) + ENGINE_PROCESS_OVERHEAD
    assert e.phase_terms()["refit"]["refit bucket"] == 2 * hf.phase_terms()["refit"]["refit bucket"]  # + its copy
    with pytest.raises(InputError) as refused_share:  # a share that cannot hold the weights: the Omni's case at TP 1
        check_memory_fit(
            load_recipe(GPU_GRPO, ["generation.backend=vllm", "generation.vllm={gpu_memory_utilization: 0.05}"])
        )
    assert refused_share.value.field == "generation.vllm.gpu_memory_utilization"
    assert "tensor parallel" in str(refused_share.value)


def test_the_gpu_recipes_dry_run_with_vllm_shows_the_engines_share_per_phase(tmp_path):
    out = vlmrun(
        "submit",
        str(ROOT / GPU_GRPO),
        "--dry-run",
        "--cluster",
        "slurm",
        "--json",
        "--set",
        "generation.backend=vllm",
        "--set",
        "model.reference_config=qwen2_5_vl_3b",
        cwd=tmp_path,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    memory = json.loads(out.stdout)["memory_estimate"]
    assert memory["engine_budget"] > 0 and set(memory["phase_totals"]) == {"forward", "backward", "refit", "generation"}
    assert memory["device_total"] <= memory["limit_bytes"]


def test_the_gpu_check_prepares_its_model_and_prompts_here_and_refuses_without_a_gpu(tmp_path):
    """tools/gpu/vllm_check.py's preparation runs anywhere: a weightless model directory of the 3B
    layout whose tokenizer and processor make prompts the engine's prompts carry back exactly; the
    check on a GPU needs one and says so (exit 2). Its CPU run: tests/test_vllm_lane_engine.py."""
    import subprocess
    import sys

    from vlmrun.generation.special_tokens import SpecialTokens
    from vlmrun.generation.vllm_requests import engine_prompts

    tools = str(ROOT / "tools" / "gpu")
    sys.path.insert(0, tools)
    try:
        import vllm_check
    finally:
        sys.path.remove(tools)
    directory, config = vllm_check.model_dir(tmp_path)
    assert config["text_config"]["vocab_size"] == 151936 and not list(directory.glob("*.safetensors"))
    batch = vllm_check.prompts(directory, 2)
    tokens = SpecialTokens.of_directory(directory)
    assert int((batch.input_ids[0] == tokens.image_token_id).sum()) == 256  # 448 px: 16 x 16 merged patches
    (sent, _) = engine_prompts(batch, tokens.image_token_id)
    assert sent["ids"].count(tokens.image_token_id) == 1 and sent["grid"] == [[1, 32, 32]]
    out = subprocess.run(
        [sys.executable, "tools/gpu/vllm_check.py"], capture_output=True, text=True, timeout=300, cwd=ROOT
    )
    assert out.returncode == 2 and json.loads(out.stdout) == {
        "ok": False,
        "error": "no CUDA device: run it on a GPU, or with --device cpu",
    }


def test_a_gpu_refits_buffer_comes_from_a_plain_block_under_expandable_segments(monkeypatch):
    """vllm_wire.classic_buffer: the project runs its ranks with expandable segments, whose IPC handles
    another torch release may not read; the refit's one buffer is allocated with them off (shown here
    with the allocator's switch recorded and a host tensor standing in)."""
    from vlmrun.generation import vllm_wire

    switched: list[str] = []
    monkeypatch.setattr(torch.cuda.memory, "_set_allocator_settings", switched.append)
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    buffer = vllm_wire.classic_buffer(512, "cpu")
    assert buffer.numel() == 512 and switched == ["expandable_segments:False", "expandable_segments:True"]
    switched.clear()
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "")
    vllm_wire.classic_buffer(512, "cpu")
    assert switched == []  # nothing to switch
