"""The sbatch script of a run: submitit's SlurmExecutor parameters plus our preamble (Jinja templates).

1. `executor_parameters(run_dir, recipe)` maps `recipe.cluster` onto submitit's sbatch parameters:
   one task per node, CPUs/GPUs/memory per node, partition/account/qos, time limit,
   `--signal=USR2@<signal_delay_s>`, `--requeue`, the job name, extra sbatch and srun arguments,
   stdout and stderr in one file per task (`<run dir>/submitit/<jobid>_<task>_log.out`).
2. The preamble comes from `templates/<cluster.sbatch_template>.sh.j2` (or a file path):
   setup lines (module loads, env exports), then the line SRUN_MARK, then srun arguments written
   as shell words (split with shlex, so the template's quoting is undone exactly once).
   With `cluster.container_image` the `pyxis` template is used and the run dir is mounted.
3. Quoting: every template expression is shell-quoted by `finalize`; submitit quotes every
   `#SBATCH` value and srun argument. What quoting cannot fix is refused by `check_shell_safety`:
   control characters (a newline ends an `#SBATCH` comment line and starts a command), sbatch
   option names that are not plain words, `%` in the run dir (SLURM expands it in log paths).
4. `render_script` returns exactly what sbatch gets (through cluster/submitit_api.py, the one module
   that touches submitit's private API); it works where `srun` is missing (a login node without
   SLURM, the unit tests).
"""

from __future__ import annotations

import os
import re
import shlex
from pathlib import Path
from typing import Any

from vlmrun.cluster import requeue, submitit_api
from vlmrun.errors import InputError

# Package data (pyproject.toml), so a non-editable install renders too; `sbatch_templates/` at the
# repository's top is a link to this folder.
TEMPLATES = Path(os.environ.get("VLMRUN_SBATCH_TEMPLATES") or Path(__file__).resolve().parent / "templates")
CONTAINER_PYTHON = "python3"  # the interpreter inside the container image (container/Dockerfile)
# append: a requeued attempt adds to its task log instead of truncating it; kill-on-bad-exit: when a
# node's entrypoint fails, the other tasks end too (a node that never joins Ray cannot hang the job)
SRUN_ALWAYS = ("--open-mode=append", "--kill-on-bad-exit=1")
SRUN_MARK = "#--- srun arguments ---"  # separates the template's setup lines from its srun arguments
_CONTROL = re.compile(r"[\x00-\x1f\x7f]")
_SBATCH_OPTION = re.compile(r"^[a-z][a-z0-9-]*$")
# Options submitit or vlmrun set for their own contract (log layout, USR2, one task per node).
RESERVED_SBATCH = frozenset(
    {
        "output",
        "error",
        "open-mode",
        "signal",
        "array",
        "wrap",
        "ntasks-per-node",
        "nodes",
        "job-name",
        "time",
        "requeue",
        "no-requeue",
    }
)


def submitit_folder(run_dir: Path) -> Path:
    return Path(run_dir) / "submitit"


def check_shell_safety(recipe, run_dir: Path) -> None:
    """Refuse the values that no quoting makes safe for an sbatch script; raises InputError."""
    c = recipe.cluster
    _no_control("--run-dir", str(run_dir))
    if "%" in str(run_dir):
        raise InputError("--run-dir", str(run_dir), "SLURM expands % in log paths: choose a run dir without %")
    for name, value in [("cluster.job_name", c.job_name), ("cluster.container_image", c.container_image)]:
        if value is not None:
            _no_control(name, value)
    for i, mount in enumerate(c.container_mounts):
        _no_control(f"cluster.container_mounts[{i}]", mount)
        if "," in mount:
            raise InputError(f"cluster.container_mounts[{i}]", mount, "one mount per entry (pyxis splits on commas)")
    for i, arg in enumerate(c.extra_srun_args):
        _no_control(f"cluster.extra_srun_args[{i}]", arg)
    for key, value in c.extra_sbatch_args.items():
        field = f"cluster.extra_sbatch_args.{key}"
        if not _SBATCH_OPTION.match(key):
            raise InputError(field, key, "sbatch option names are lowercase words with dashes, without the leading --")
        if key in RESERVED_SBATCH:
            raise InputError(field, key, f"vlmrun sets --{key} itself; use the matching cluster.* field")
        _no_control(field, str(value))


def _no_control(field: str, value: str) -> None:
    if _CONTROL.search(value):
        raise InputError(field, value, "control characters (newline, tab, ...) are not allowed here")


def executor_parameters(run_dir: Path, recipe) -> dict[str, Any]:
    """submitit `SlurmExecutor.update_parameters` keywords for `recipe` (sbatch names)."""
    c = recipe.cluster
    setup, srun_args = render_preamble(recipe, run_dir)
    params: dict[str, Any] = {
        "job_name": c.job_name or recipe.name,
        "nodes": c.nodes,
        "ntasks_per_node": 1,
        "cpus_per_task": c.cpus_per_node,
        "time": c.time_limit,
        "signal_delay_s": c.signal_delay_s,
        "stderr_to_stdout": True,
        "setup": setup,
        "srun_args": [*SRUN_ALWAYS, *srun_args, *c.extra_srun_args],
        "additional_parameters": {"requeue": True, **{k: str(v) for k, v in c.extra_sbatch_args.items()}},
    }
    if c.gpus_per_node:
        params["gpus_per_node"] = c.gpus_per_node
    if c.mem_gb:
        params["mem"] = f"{c.mem_gb}GB"
    for name in ("partition", "account", "qos"):
        if getattr(c, name):
            params[name] = getattr(c, name)
    return params


def template_name(recipe) -> str:
    c = recipe.cluster
    return "pyxis" if c.container_image and c.sbatch_template == "default" else c.sbatch_template


def render_preamble(recipe, run_dir: Path) -> tuple[list[str], list[str]]:
    """(setup lines, srun arguments) from the recipe's sbatch template; every value shell-quoted."""
    c = recipe.cluster
    mounts = list(c.container_mounts)
    if c.container_image and not any(m.split(":")[0] == str(run_dir) for m in mounts):
        mounts.append(f"{run_dir}:{run_dir}")
    template = _load_template(template_name(recipe))
    setup, _, srun = template.render(
        env=dict(c.env),
        modules=list(c.modules),
        container_image=c.container_image,
        container_mounts=mounts,
        run_dir=str(run_dir),
        nodes=c.nodes,
    ).partition(SRUN_MARK)
    return [line for line in setup.splitlines() if line.strip()], shlex.split(srun)


def _load_template(name: str):
    import jinja2

    path = Path(name)
    dirs = [str(TEMPLATES)]
    if path.suffix == ".j2" or "/" in name:
        if not path.is_file():
            raise InputError("cluster.sbatch_template", name, "no such template file")
        dirs.insert(0, str(path.resolve().parent))
        file = path.name
    else:
        file = f"{name}.sh.j2"
        if not (TEMPLATES / file).is_file():
            known = sorted(p.name.removesuffix(".sh.j2") for p in TEMPLATES.glob("*.sh.j2"))
            raise InputError(
                "cluster.sbatch_template",
                name,
                f"choose one of {', '.join(known)} (in {TEMPLATES}) or a path to a .j2 file",
            )
    env = jinja2.Environment(
        loader=jinja2.FileSystemLoader(dirs),
        undefined=jinja2.StrictUndefined,
        trim_blocks=True,
        lstrip_blocks=True,
        keep_trailing_newline=True,
        autoescape=False,
        finalize=_shell_quote,
    )
    try:
        return env.get_template(file)
    except jinja2.TemplateError as e:
        raise InputError("cluster.sbatch_template", name, f"template error: {e}") from None


def _shell_quote(value: Any) -> str:
    return shlex.quote(str(value))


def make_executor(run_dir: Path, recipe, *, render_only: bool = False):
    """A submitit SlurmExecutor for the run (`render_only`: usable where `srun` is missing); submitit's
    count of time-limit requeues starts at what a new job id has left (cluster/requeue.py).

    Raises SubmititChanged when the installed submitit lacks what vlmrun relies on."""
    submitit_api.require_api()
    cls = submitit_api.RenderOnlyExecutor if render_only else submitit_api.HeldSlurmExecutor
    python = CONTAINER_PYTHON if recipe.cluster.container_image else None
    timeouts = requeue.timeouts_left([], None, recipe.checkpoint.requeue)
    executor = cls(folder=submitit_folder(run_dir), max_num_timeout=timeouts, python=python)
    executor.update_parameters(**executor_parameters(run_dir, recipe))
    return executor


def render_script(run_dir: Path, recipe) -> str:
    """The exact sbatch script `submit` would hand to sbatch (minus the job id, which SLURM assigns)."""
    check_shell_safety(recipe, run_dir)
    return submitit_api.submission_script(make_executor(run_dir, recipe, render_only=True))
