"""A non-editable install renders the same sbatch script as this checkout: the templates ship as package data.

The fresh venv gets only vlmrun itself (`--no-deps`, no download); a `.pth` line makes this venv's
site-packages (torch, submitit, ...) importable there. A path line in a `.pth` does not run the `.pth`
files in that folder, so this checkout's editable finder stays off and `vlmrun` comes from the wheel.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "recipes" / "tiny-clevr-cpu.yaml"
RUN_DIR = "/shared/runs/install-check"
# Each template of the package data, with a line that only it writes: (overrides, that line).
VARIANTS = {
    "default": (["cluster.modules=[cuda/12.4]", "cluster.env={NCCL_DEBUG: WARN}"], "module load cuda/12.4"),
    "pyxis": (["cluster.container_image=nvcr.io#nvidia/pytorch:25.01-py3"], "--container-image=nvcr.io#nvidia"),
}


def run(*cmd, **kw) -> subprocess.CompletedProcess:
    out = subprocess.run([str(c) for c in cmd], capture_output=True, text=True, timeout=300, **kw)
    assert out.returncode == 0, f"{cmd}:\n{out.stdout}\n{out.stderr}"
    return out


def clean_env(**extra: str) -> dict[str, str]:
    """No PYTHONPATH and no template override: what a user's shell would have."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VLMRUN_SBATCH_TEMPLATES", "VIRTUAL_ENV")}
    return env | {"HF_HUB_OFFLINE": "1", "PIP_DISABLE_PIP_VERSION_CHECK": "1", **extra}


def copy_project(dest: Path) -> Path:
    """The files a build reads, so the build writes its egg-info and build/ there, not into the checkout."""
    shutil.copytree(ROOT / "vlmrun", dest / "vlmrun", ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy2(ROOT / name, dest / name)
    return dest


def install_fresh(tmp_path: Path) -> Path:
    """A new venv holding a wheel of this project (pip install ., non-editable) and nothing else of its own."""
    venv = tmp_path / "venv"
    run(sys.executable, "-m", "venv", "--without-pip", venv)
    python = venv / "bin" / "python"
    src = copy_project(tmp_path / "src")
    run(
        sys.executable,
        "-m",
        "pip",
        "wheel",
        "--no-deps",
        "--no-build-isolation",
        "--no-index",
        "-w",
        tmp_path / "dist",
        src,
        env=clean_env(),
    )
    [wheel] = (tmp_path / "dist").glob("vlmrun-*.whl")
    run(sys.executable, "-m", "pip", "--python", python, "install", "--no-deps", "--no-index", wheel, env=clean_env())
    purelib = Path(run(python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])").stdout.strip())
    deps = {sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]}
    (purelib / "project_deps.pth").write_text("".join(f"{p}\n" for p in sorted(deps)))
    return venv


def render(vlmrun: Path, sets: list[str], cwd: Path) -> str:
    args = [vlmrun, "submit", TINY, "--cluster", "slurm", "--dry-run", "--run-dir", RUN_DIR]
    for item in sets:
        args += ["--set", item]
    return run(*args, cwd=cwd, env=clean_env()).stdout


@pytest.mark.slow
def test_non_editable_install_renders_the_same_script(tmp_path):
    venv = install_fresh(tmp_path)
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    where = run(
        venv / "bin" / "python",
        "-c",
        "import vlmrun, vlmrun.launch.slurm.render as r; print(vlmrun.__file__); print(r.TEMPLATES)",
        cwd=outside,
        env=clean_env(),
    ).stdout.split()
    assert all(Path(p).is_relative_to(venv) for p in where), where
    assert (Path(where[1]) / "default.sh.j2").is_file() and (Path(where[1]) / "pyxis.sh.j2").is_file()
    here_bin = Path(sys.executable).parent
    for name, (sets, line) in VARIANTS.items():
        fresh = render(venv / "bin" / "vlmrun", sets, outside)
        editable = render(here_bin / "vlmrun", sets, outside)
        assert line in fresh, f"{name}: the template's line is missing"
        if name == "default":  # outside a container the job runs the submitting interpreter
            assert str(venv / "bin" / "python") in fresh, "the fresh install's script must start its own python"
        assert normalized(fresh, venv / "bin") == normalized(editable, here_bin), name


def normalized(script: str, bin_dir: Path) -> str:
    """The script with this environment's interpreter (python, python3, python3.11) written as {PYTHON}."""
    return re.sub(re.escape(str(bin_dir)) + r"/python[0-9.]*", "{PYTHON}", script)
