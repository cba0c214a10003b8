"""The real runs several test modules compare against or start from, each made once per session
(a pytest plugin: tests/conftest.py names it), and the one local Ray of the in-process tests.

Every real run trains on one CLEVR set (`run_data`). The uninterrupted SFT run (`sft_baseline`) is
what every interrupted SFT run must equal at every step: on the local cluster
(test_chaos_processes.py), with FSDP2 (test_fsdp_runs.py), on SLURM (test_slurm_sft.py), and the v1
loop (test_sft.py); its final checkpoint, exported, is
the policy GRPO starts from (a random tiny model earns almost no reward). The uninterrupted GRPO run
(`grpo_want`) is what every interrupted GRPO run must equal, on every data plane (test_grpo_e2e.py,
test_slurm_chaos.py). `finished_run` is a short run that completed, for the tests that resume, damage
or export one (copy it before changing it).
"""

from __future__ import annotations

import fcntl
import os
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
from vlmrun_cli import GRPO, TINY, sets, vlmrun

from vlmrun.run.metrics import history

RUN_DATA = {"train": 256, "val": 32, "image_size": 112, "seed": 0}
#: The SFT runs compared with `sft_baseline`: 40 steps (epoch 0 and part of epoch 1), a checkpoint
#: every 3 steps, validation every 10 on 8 val samples; the recipe's loader worker (num_workers 1).
SFT_STEPS = 40
SFT_SETS = [
    *("train.max_steps=40", "train.epochs=2", "checkpoint.save_period=3"),
    *("train.val_samples=8", "train.val_period=10"),
]
#: The GRPO runs compared with `grpo_want`: 8 steps of 8 prompts x 4 responses, a checkpoint every 2.
GRPO_STEPS = 8
GRPO_SETS = ["train.max_steps=8", "checkpoint.save_period=2"]


def made_once(tmp_path_factory, name: str, make: Callable[[Path], object]) -> Path:
    """The folder `name`, made by `make(folder)` once for the whole session: every pytest process of
    it (pytest-xdist's workers share the parent of their base temp dirs) takes the same folder; the
    first makes it under a lock while the others wait. A make that failed is tried again from scratch."""
    base = tmp_path_factory.getbasetemp()
    root = base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base
    folder, made = root / name, root / f"{name}.made"
    with open(root / f"{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        if not made.exists():
            shutil.rmtree(folder, ignore_errors=True)
            folder.mkdir()
            make(folder)
            made.touch()
    return folder


@pytest.fixture(scope="session")
def run_data(tmp_path_factory) -> list[str]:
    """`--set` arguments for the CLEVR set every real run trains on (generated here, once)."""
    from vlmrun.datasets.clevr import ensure_clevr

    path = made_once(tmp_path_factory, "vlmrun-runs-clevr", lambda f: ensure_clevr(f / "clevr", **RUN_DATA)) / "clevr"
    spec = ", ".join(f"{k}: {v}" for k, v in RUN_DATA.items())
    return sets(f"data.path={path}", f"data.synthetic={{{spec}}}", "logger.wandb_mode=disabled")


def submit_args(run: Path, *args: str, recipe: str = TINY) -> list[str]:
    """The arguments of `vlmrun submit RECIPE --cluster local --run-dir RUN ARGS --wait`."""
    return ["submit", recipe, "--cluster", "local", "--run-dir", str(run), *args, "--wait"]


def submit(run: Path, *args: str, recipe: str = TINY, timeout: float = 600) -> Path:
    """`vlmrun submit RECIPE --cluster local --run-dir RUN ARGS --wait`, which must complete."""
    out = vlmrun(*submit_args(run, *args, recipe=recipe), timeout=timeout)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    return run


@pytest.fixture(scope="session")
def sft_sets(run_data) -> list[str]:
    """The arguments of `sft_baseline`: a run given them (and nothing that changes its numbers) must equal it."""
    return [*run_data, *sets(*SFT_SETS)]


@pytest.fixture(scope="session")
def sft_baseline(tmp_path_factory, sft_sets) -> Path:
    """The uninterrupted SFT run of the tiny recipe (model.tiny: built into its cache)."""
    return made_once(tmp_path_factory, "sft-baseline", lambda f: submit(f / "run", *sft_sets)) / "run"


@pytest.fixture(scope="session")
def grpo_policy(tmp_path_factory, sft_baseline) -> Path:
    """`vlmrun export` of the SFT baseline's final checkpoint: the model GRPO runs start from."""

    def export(folder: Path) -> None:
        done = vlmrun("export", str(sft_baseline), str(folder / "model"))
        assert done.returncode == 0, done.stderr[-3000:]

    return made_once(tmp_path_factory, "grpo-policy", export) / "model"


@pytest.fixture(scope="session")
def grpo_sets(run_data, grpo_policy) -> list[str]:
    """The arguments of `grpo_want` (the local plane: the recipe's)."""
    small = ["train.global_batch_size=8", "grpo.num_generations=4", "train.val_period=3", "train.val_samples=8"]
    policy = ["model.tiny=false", f"model.path={grpo_policy}"]
    return [*run_data, *sets(*small, *policy, *GRPO_SETS)]


@pytest.fixture(scope="session")
def grpo_want(tmp_path_factory, grpo_sets) -> Path:
    """The uninterrupted GRPO run from the exported policy: what every interrupted one must match."""
    run = made_once(tmp_path_factory, "grpo-want", lambda f: submit(f / "run", *grpo_sets, recipe=GRPO)) / "run"
    assert sorted(history(run / "metrics.jsonl")) == list(range(1, GRPO_STEPS + 1))
    return run


@pytest.fixture(scope="session")
def finished_run(tmp_path_factory, run_data) -> Path:
    """A tiny SFT run that completed 4 steps, with checkpoints at steps 2 and 4 (keep 2); no loader
    worker, no validation; a constant LR (after the warmup), so a resume's train.max_steps does not
    change the numbers of the steps it trains. Tests that change it work on a copy (`copy_run`)."""
    quick = ["train.max_steps=4", "checkpoint.save_period=2", "train.val_samples=0", "data.num_workers=0"]
    quick.append("train.lr_schedule=constant")
    return made_once(tmp_path_factory, "finished", lambda f: submit(f / "run", *run_data, *sets(*quick))) / "run"


def copy_run(run: Path, to: Path) -> Path:
    """A copy of run directory `run` at `to` (its model cache left out: a copy rebuilds nothing it needs)."""
    import shutil

    shutil.copytree(run, to, ignore=shutil.ignore_patterns("cache"))
    return to


@pytest.fixture(scope="session")
def ray_local():
    """One local Ray for the tests that drive actors in-process (4 CPUs); the workers import from tests/."""
    from vlmrun.cluster.ray.local import start_local_ray

    saved = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(Path(__file__).parent), saved) if p)
    start_local_ray("vlmrun-tests", 4)  # sets Ray's loopback environment before Ray is imported
    import ray

    yield
    ray.shutdown()
    if saved is None:
        os.environ.pop("PYTHONPATH")
    else:
        os.environ["PYTHONPATH"] = saved
