"""The sbatch script vlmrun renders: pinned by golden files, and no recipe value can execute in it.

Regenerate the golden files after an intended change: VLMRUN_UPDATE_GOLDEN=1 pytest tests/test_slurm_render.py
"""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from vlmrun.config.load import load_recipe
from vlmrun.errors import InputError
from vlmrun.launch.slurm.render import executor_parameters, render_preamble, render_script

ROOT = Path(__file__).resolve().parents[1]
GOLDEN = Path(__file__).resolve().parent / "golden"
RUN_DIR = Path("/shared/runs/demo-20261130-101500")

# Each hostile string tries to create the sentinel file if the shell ever evaluates it.
HOSTILE = [
    "x'; touch SENTINEL; echo '",
    '"; touch SENTINEL; echo "',
    "$(touch SENTINEL)",
    "`touch SENTINEL`",
    "; touch SENTINEL",
    "a && touch SENTINEL || b",
    "$HOME ${IFS} \\ \\n * ?",
]
HOSTILE_NL = "first line\ntouch SENTINEL"

RECIPES = {
    "tiny": ("tiny-clevr-cpu.yaml", []),
    "1n2g": ("qwen2.5-vl-3b-clevr-1n2g.yaml", ["cluster.partition=gpu", "cluster.account=proj-42", "cluster.qos=high"]),
    "omni": (
        "omni-clevr-1n8g.yaml",
        ["cluster.env={NCCL_DEBUG: WARN, HF_HUB_OFFLINE: '1'}", "cluster.modules=[cuda/12.4, nccl]"],
    ),
    "container": (
        "omni-clevr-1n8g.yaml",
        [
            "cluster.container_image=nvcr.io#nvidia/pytorch:25.01-py3",
            "cluster.container_mounts=[/data:/data, /models:/models:ro]",
            "cluster.extra_sbatch_args={exclusive: user}",
            "cluster.extra_srun_args=[--cpu-bind=none]",
        ],
    ),
}


def recipe(name: str, extra: list[str] = ()):
    file, sets = RECIPES.get(name, (name, []))
    return load_recipe(ROOT / "recipes" / file, [*sets, *extra])


def normalized(text: str, run_dir: Path = RUN_DIR) -> str:
    return text.replace(str(run_dir), "{RUN_DIR}").replace(shlex.quote(sys.executable), "{PYTHON}")


@pytest.mark.parametrize("name", sorted(RECIPES))
def test_rendered_script_matches_golden(name):
    text = normalized(render_script(RUN_DIR, recipe(name)))
    golden = GOLDEN / f"slurm_{name}.sh"
    if os.environ.get("VLMRUN_UPDATE_GOLDEN"):
        golden.write_text(text)
    assert text == golden.read_text(), f"rendered script differs from {golden}; see the module docstring"


def test_script_carries_the_cluster_fields():
    text = render_script(
        RUN_DIR,
        recipe(
            "1n2g",
            [
                "cluster.nodes=2",
                "cluster.gpus_per_node=1",
                "cluster.mem_gb=64",
                "cluster.time_limit=01:30:00",
                "cluster.signal_delay_s=240",
            ],
        ),
    )
    for line in [
        "#SBATCH --nodes=2",
        "#SBATCH --ntasks-per-node=1",
        "#SBATCH --gpus-per-node=1",
        "#SBATCH --cpus-per-task=16",
        "#SBATCH --mem=64GB",
        "#SBATCH --partition=gpu",
        "#SBATCH --account=proj-42",
        "#SBATCH --qos=high",
        "#SBATCH --time=90",
        "#SBATCH --signal=USR2@240",
        "#SBATCH --requeue",
        "#SBATCH --job-name=qwen2.5-vl-3b-clevr",
        f"#SBATCH --output={RUN_DIR}/submitit/%j_0_log.out",
    ]:
        assert line in text.splitlines(), line
    assert "--error" not in text  # stdout and stderr share one file per task


def test_container_uses_pyxis_and_mounts_the_run_dir():
    params = executor_parameters(RUN_DIR, recipe("container"))
    assert "--container-image=nvcr.io#nvidia/pytorch:25.01-py3" in params["srun_args"]
    assert f"--container-mounts=/data:/data,/models:/models:ro,{RUN_DIR}:{RUN_DIR}" in params["srun_args"]
    assert (
        render_script(RUN_DIR, recipe("container"))
        .rstrip()
        .splitlines()[-1]
        .endswith(f"python3 -u -m submitit.core._submit {RUN_DIR}/submitit")
    )


def test_unknown_template_names_the_field():
    with pytest.raises(InputError) as e:
        render_script(RUN_DIR, recipe("tiny", ["cluster.sbatch_template=nosuch"]))
    assert "cluster.sbatch_template" in str(e.value) and "default" in str(e.value)


def test_custom_template_file_can_extend_default(tmp_path):
    t = tmp_path / "site.sh.j2"
    t.write_text('{% extends "default.sh.j2" %}{% block srun_args %}--mpi={{ "pmix x" }}\n{% endblock %}')
    _, srun = render_preamble(recipe("tiny", [f"cluster.sbatch_template={t}"]), RUN_DIR)
    assert srun == ["--mpi=pmix x"]


# ---------------------------------------------------------------- hostile strings


def hostile_recipe(value: str):
    """The tiny recipe with `value` in every cluster field that reaches the script."""
    base = recipe("tiny")
    cluster = base.cluster.model_copy(
        update={
            "job_name": value,
            "env": {"VLM_EVIL": value, "VLM_MULTI": HOSTILE_NL},
            "modules": [value, HOSTILE_NL],
            "container_image": value,
            "container_mounts": [f"/data:/in{value}"],
            "extra_srun_args": [value],
            "extra_sbatch_args": {"comment": value},
        }
    )
    return base.model_copy(update={"cluster": cluster})


def run_script(script: str, workdir: Path) -> subprocess.CompletedProcess:
    """Run the rendered script with `srun` and `module` replaced by recorders (bash functions)."""
    (workdir / "job.sh").write_text(script)
    fake = (
        'srun() { for a in "$@"; do printf "%s\\0" "$a"; done > srun.args; '
        'printf "%s\\0" "$VLM_EVIL" "$VLM_MULTI" > env.values; }; '
        'module() { for a in "$@"; do printf "%s\\0" "$a"; done >> module.args; }; '
        "export -f srun module; bash job.sh"
    )
    return subprocess.run(["bash", "-c", fake], cwd=workdir, capture_output=True, text=True, timeout=30)


@pytest.mark.parametrize("value", HOSTILE)
def test_hostile_values_render_inert(tmp_path, value):
    run_dir = tmp_path / f"run {value}".replace("/", "_").replace("%", "_")
    text = render_script(run_dir, hostile_recipe(value))
    check = subprocess.run(["bash", "-n"], input=text, capture_output=True, text=True)
    assert check.returncode == 0, check.stderr
    work = tmp_path / "work"
    work.mkdir()
    proc = run_script(text, work)
    assert proc.returncode == 0, proc.stderr
    assert not list(tmp_path.rglob("SENTINEL")), "a recipe value executed"
    srun_args = (work / "srun.args").read_text().split("\0")[:-1]
    assert value in srun_args and f"--container-image={value}" in srun_args
    assert f"--container-mounts=/data:/in{value},{run_dir}:{run_dir}" in srun_args
    assert (work / "env.values").read_text().split("\0")[:-1] == [value, HOSTILE_NL]
    assert (work / "module.args").read_text().split("\0")[:-1] == ["load", value, "load", HOSTILE_NL]


@pytest.mark.parametrize(
    "field,update",
    [
        ("cluster.job_name", {"job_name": "ok\ntouch SENTINEL"}),
        ("cluster.extra_sbatch_args.comment", {"extra_sbatch_args": {"comment": "a\ntouch SENTINEL"}}),
        ("cluster.extra_sbatch_args", {"extra_sbatch_args": {"x\ntouch SENTINEL": "1"}}),
        ("cluster.extra_sbatch_args.output", {"extra_sbatch_args": {"output": "/elsewhere"}}),
        ("cluster.container_mounts[0]", {"container_mounts": ["/a:/b,/etc:/etc"]}),
        ("cluster.extra_srun_args[0]", {"extra_srun_args": ["--x=\n"]}),
    ],
)
def test_values_no_quoting_can_fix_are_refused(field, update):
    base = recipe("tiny")
    bad = base.model_copy(update={"cluster": base.cluster.model_copy(update=update)})
    with pytest.raises(InputError) as e:
        render_script(RUN_DIR, bad)
    assert field in str(e.value)


@pytest.mark.parametrize("run_dir", ["/runs/a\ntouch SENTINEL", "/runs/100%done"])
def test_run_dir_that_breaks_the_script_is_refused(run_dir):
    with pytest.raises(InputError) as e:
        render_script(Path(run_dir), recipe("tiny"))
    assert "--run-dir" in str(e.value)
