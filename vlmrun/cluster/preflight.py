"""Checks before a run starts: the model, the data and (on this machine) the GPUs are there.

`preflight_run` is what `vlmrun submit` (dry runs too) and `vlmrun resume` call before they create a
run directory, generate data or start a process, so a run that cannot work fails in a second, naming
the field, instead of inside the job; the node entrypoint calls it again when the job starts (the
files may have changed since, and on SLURM this is the machine that has the GPUs). The checks read
the filesystem only: no torch, ray or transformers import.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from vlmrun.data.components import check_components
from vlmrun.data.splits import split_shards, split_size
from vlmrun.errors import InputError
from vlmrun.models.source import check_model_source

NVIDIA_PROC = Path("/proc/driver/nvidia/gpus")
_DEV = Path("/dev")
_DEV_GPU = re.compile(r"^nvidia\d+$")


def preflight_run(recipe, *, runs_here: bool, dry_run: bool = False) -> None:
    """Raise InputError naming the field when `recipe` cannot start.

    `runs_here`: the run executes on this machine (`--cluster local`), so this machine must have the
    GPUs it asks for; a SLURM run's GPUs are checked against the partition (launch/slurm/preflight.py).
    `dry_run`: nothing will run, so a model.path missing here passes when model.reference_config can
    stand in for its config.json (the estimate); a model.path that holds another family's model is
    refused either way. Paths must already be absolute (config.load.load_recipe resolves them).
    """
    check_model_source(recipe.model, weights_here=not dry_run)
    check_components(recipe)
    check_data(recipe.data, val=recipe.train.val_samples > 0)
    check_data_size(recipe)
    check_checkpoint_dir(recipe.checkpoint.dir)
    check_rewards(recipe)
    if runs_here:
        check_local_gpus(recipe.cluster.gpus_per_node)
        check_local_mooncake(recipe.data_plane)
        check_local_packages({"model.attn_implementation": recipe.model.attn_implementation})
        check_model_kernels(recipe)
        check_engine_environment(recipe)


def check_rewards(recipe) -> None:
    """GRPO's reward functions (grpo.rewards) import here and can be called as fn(response, sample, ended);
    the ranks import them again on their nodes (InputError naming grpo.rewards[i].fn)."""
    if recipe.train.algorithm != "grpo" or not recipe.grpo.rewards:
        return
    from vlmrun.rewards.terms import reward_terms

    reward_terms(recipe.grpo)


#: A recipe value that needs a package where the ranks run: (field, value, package's import name, the
#: package's name in words, how to get it, the value that needs nothing).
NEEDS_PACKAGE = (
    (
        "model.attn_implementation",
        "flash_attention_2",
        "flash_attn",
        "flash-attn",
        "pip install 'vlmrun[gpu]' on a CUDA machine, or the container",
        "sdpa",
    ),
)


def check_local_packages(values: dict[str, str]) -> None:
    """Each recipe value of `values` (field -> value) that NEEDS_PACKAGE lists has its package here (found,
    not imported: flash-attn imports torch and CUDA's libraries)."""
    import importlib.util

    for field, value, module, package, install, instead in NEEDS_PACKAGE:
        if values.get(field) == value and importlib.util.find_spec(module) is None:
            raise InputError(
                field,
                value,
                message=f"{field}: {value} needs the {package} package on the nodes, and it is not installed "
                f"here ({install}); or set {field}: {instead}",
            )


#: A family whose GPU ranks need compiled kernels (transformers falls back to a slow reference path
#: without saying so: policy/kernels.py, which the ranks check again by importing them).
FAMILY_KERNELS = {"nemotron_omni": ("mamba_ssm", "causal_conv1d")}


def check_model_kernels(recipe) -> None:
    """A GPU run of a family in FAMILY_KERNELS needs them where its ranks run (found, not imported)."""
    import importlib.util

    needed = FAMILY_KERNELS.get(recipe.model.family, ())
    missing = [m for m in needed if recipe.cluster.gpus_per_node > 0 and importlib.util.find_spec(m) is None]
    if missing:
        raise InputError(
            "model.family",
            recipe.model.family,
            message=f"model.family: {recipe.model.family} on GPUs needs the Mamba kernels ({', '.join(needed)}) on the "
            f"nodes, and {', '.join(missing)} is not installed here: transformers would fall back to its slow reference "
            "path; install the gpu extra (pip install --no-build-isolation 'vlmrun[gpu]', against the nodes' torch) "
            "or use the container (container/README.md)",
        )


def check_engine_environment(recipe) -> None:
    """generation.backend: vllm runs its engine in an environment of its own (vlmrun/generation/vllm_env.py),
    which must be built on this machine, for this Python and the run's kind (CPU or GPU)."""
    if recipe.generation.backend != "vllm":
        return
    from vlmrun.generation.vllm_env import engine_environment

    g = recipe.generation
    engine_environment(g.vllm.env if g.vllm is not None else None, on_gpu=recipe.cluster.gpus_per_node > 0)


def check_local_mooncake(data_plane) -> None:
    """A plane with `backend: mooncake` needs Mooncake on the machine that runs it (the recipe's
    `data_plane` section; a disabled plane starts no server)."""
    if not (data_plane.enabled and data_plane.impl == "transfer_queue" and data_plane.backend == "mooncake"):
        return
    from vlmrun.cluster.mooncake import mooncake_unavailable

    reason = mooncake_unavailable()
    if reason:
        raise InputError("data_plane.backend", "mooncake", message=f"data_plane.backend: mooncake: {reason}")


def check_checkpoint_dir(directory: str | None) -> None:
    """An explicit `checkpoint.dir` must be a writable directory, or creatable under one (None: the run
    dir's checkpoints/, which submit creates)."""
    if directory is None:
        return
    path = Path(directory)
    if path.exists() and not path.is_dir():
        raise InputError("checkpoint.dir", str(path), message=f"checkpoint.dir: {path} is a file, not a directory")
    parent = nearest_existing(path)
    if not parent.is_dir() or not os.access(parent, os.W_OK | os.X_OK):
        why = "is not a directory" if not parent.is_dir() else "is not writable"
        raise InputError(
            "checkpoint.dir",
            str(path),
            message=f"checkpoint.dir: {path} cannot be written: {parent} {why}; choose a writable directory",
        )


def check_data_size(recipe) -> None:
    """The training split must give every loader worker of every replica at least one micro-batch.

    Energon splits a split's samples over the dp replicas and each replica's loader workers; an empty
    slice fails inside the job ("Cannot repeat empty dataset"). Call after `check_data`.
    """
    d, t = recipe.data, recipe.train
    samples = d.synthetic.train if d.synthetic is not None else split_size(d.path, d.split)
    slices = recipe.parallel.dp * max(1, d.num_workers)
    need = slices * t.micro_batch_size
    if samples < need:
        raise InputError(
            "data.path",
            d.path,
            message=f"data.path: split {d.split!r} has {samples} sample(s), fewer than parallel.dp x "
            f"max(1, data.num_workers) x train.micro_batch_size = {recipe.parallel.dp} x {max(1, d.num_workers)} x "
            f"{t.micro_batch_size} = {need}: every loader worker of every replica needs a micro-batch; use more "
            "data, or lower parallel.dp, data.num_workers or train.micro_batch_size",
        )


def check_data(data, *, val: bool) -> None:
    """A prepared `data.path` must hold the splits the run reads; a synthetic one must be writable to make.

    `val`: the run validates (train.val_samples > 0), so `data.val_split` must exist too.
    """
    if data.synthetic is not None:
        _check_synthetic(data, val=val)
        return
    split_shards(data.path, data.split)
    if val:
        try:
            split_shards(data.path, data.val_split)
        except InputError as e:
            if e.field != "data.split":
                raise
            raise InputError(
                "data.val_split", data.val_split, f"{e.allowed}; or set train.val_samples=0 to train without validation"
            ) from None


def _check_synthetic(data, *, val: bool) -> None:
    from vlmrun.datasets.clevr import SPLITS, read_complete

    wanted = [("data.split", data.split)] + ([("data.val_split", data.val_split)] if val else [])
    for field, split in wanted:
        if split not in SPLITS:
            raise InputError(field, split, f"a synthetic (data.synthetic) set has the splits {', '.join(SPLITS)}")
    path = Path(data.path)
    if path.exists() and not path.is_dir():
        raise InputError(
            "data.path",
            str(path),
            message=f"data.path: {path} is a file; a synthetic set needs a directory there, or nothing yet",
        )
    found = read_complete(path)
    if found is not None:
        _check_synthetic_made_so(data, found.params)
        return
    # The set is generated in a hidden sibling of data.path, created with its parents, then renamed.
    parent = nearest_existing(path.parent)
    if not parent.is_dir() or not os.access(parent, os.W_OK | os.X_OK):
        why = "is not a directory" if not parent.is_dir() else "is not writable"
        raise InputError(
            "data.path",
            str(path),
            message=f"data.path: {path} is generated on first use "
            f"(data.synthetic), but {parent} {why}; choose a data.path under a writable directory",
        )


def _check_synthetic_made_so(data, made) -> None:
    """A synthetic set already at data.path must be the one `data.synthetic` asks for (the job would
    refuse it, after the queue and Ray's start-up)."""
    for field in ("train", "val", "image_size", "seed"):
        wanted, there = getattr(data.synthetic, field), getattr(made, field)
        if wanted != there:
            raise InputError(
                f"data.synthetic.{field}",
                wanted,
                message=f"data.synthetic.{field}: {wanted}, but {data.path} holds a CLEVR set made with "
                f"{field}={there}; set data.synthetic.{field}={there}, or choose another data.path",
            )


def nearest_existing(path: Path) -> Path:
    """`path` or its closest ancestor that exists (a file, too: the caller decides what that means)."""
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def check_local_gpus(wanted: int) -> None:
    """This machine must show at least `wanted` GPUs (cluster.gpus_per_node) when the run executes here."""
    if wanted <= 0:
        return
    found = visible_gpus()
    if found < wanted:
        mask = os.environ.get("CUDA_VISIBLE_DEVICES")
        seen = f" (CUDA_VISIBLE_DEVICES={mask!r})" if mask is not None else ""
        raise InputError(
            "cluster.gpus_per_node",
            wanted,
            message=f"cluster.gpus_per_node: {wanted} GPUs wanted, but "
            f"this machine has {found}{seen} and --cluster local runs here; use a machine with {wanted} "
            "GPUs, --cluster slurm, or a CPU recipe (cluster.gpus_per_node=0)",
        )


def visible_gpus(env: dict[str, str] | None = None) -> int:
    """GPUs a process started here may use: the NVIDIA driver's GPUs, narrowed by CUDA_VISIBLE_DEVICES.

    Reads /proc/driver/nvidia/gpus (one folder per GPU), else counts /dev/nvidiaN; never imports torch.
    Like CUDA, reading CUDA_VISIBLE_DEVICES stops at the first entry that names no GPU here.
    """
    env = os.environ if env is None else env
    physical = physical_gpus()
    mask = env.get("CUDA_VISIBLE_DEVICES")
    if mask is None:
        return physical
    count = 0
    for item in mask.split(","):
        item = item.strip()
        if not item or (item.lstrip("-").isdigit() and not 0 <= int(item) < physical):
            break
        count += 1
    return min(count, physical)


def physical_gpus(proc: Path = NVIDIA_PROC, dev: Path = _DEV) -> int:
    """NVIDIA GPUs the driver shows this machine (or container); 0 without a driver."""
    try:
        listed = sum(1 for _ in proc.iterdir())
    except OSError:
        listed = 0
    if listed:
        return listed
    try:
        return sum(1 for p in dev.iterdir() if _DEV_GPU.match(p.name))
    except OSError:
        return 0
