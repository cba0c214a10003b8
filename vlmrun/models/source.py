"""Where a run's model comes from: a local HF directory, or a tiny one built into the run's cache.

The checks read model.path's config.json only (no torch, no transformers: fast on a login node), so
a directory that cannot be the recipe's model is refused at submit, not inside the job.
"""

from __future__ import annotations

import json
import os
import socket
from pathlib import Path

from vlmrun.config.families import FAMILIES, family_of_model_type
from vlmrun.errors import InputError


def check_model_source(model, *, weights_here: bool = True) -> None:
    """A `model.path` must be a local Hugging Face directory whose config.json describes `model.family`
    (tiny models are built).

    `model` is the recipe's ModelConfig. `weights_here=False` (a dry run) lets a missing directory
    pass when `model.reference_config` can stand in for its config.json in the memory estimate.
    Raises InputError on model.path (missing, or config.json unreadable) or model.family (the
    directory holds another family's model).
    """
    if model.tiny:
        return
    config = read_model_config(Path(model.path))
    if config is None:
        if not weights_here and model.reference_config is not None:
            return
        raise InputError("model.path", model.path, message=_missing_message(model))
    check_model_family(model.family, config, Path(model.path) / "config.json")


def read_model_config(path: Path) -> dict | None:
    """The config.json of model directory `path`, or None when there is none; InputError on model.path
    when it is there but is not a JSON object."""
    config_file = path / "config.json"
    try:
        config = json.loads(config_file.read_text())
    except FileNotFoundError:
        return None
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise InputError(
            "model.path", str(path), message=f"model.path: {config_file} cannot be read ({type(e).__name__}: {e})"
        ) from None
    if not isinstance(config, dict):
        raise InputError("model.path", str(path), message=f"model.path: {config_file} is not a JSON object")
    return config


def check_model_family(family: str, config: dict, config_file: Path) -> None:
    """Refuse (InputError on model.family) a config.json whose `model_type` is not one of `family`'s.

    A config without `model_type` says nothing about its family (a placeholder) and passes.
    """
    model_type = config.get("model_type")
    if not isinstance(model_type, str) or model_type in FAMILIES[family].model_types:
        return
    holds = f"{config_file} describes a {model_type!r} model"
    if isinstance(config.get("architectures"), list) and config["architectures"]:
        holds += f" ({', '.join(map(str, config['architectures']))})"
    other = family_of_model_type(model_type)
    fix = (
        f"that is family {other!r}: set model.family={other}, or point model.path at a {family} model"
        if other
        else f"no vlmrun family reads it (families: {', '.join(FAMILIES)}): point model.path at a {family} model"
    )
    raise InputError("model.family", family, message=f"model.family: {family!r}, but {holds}; {fix}")


def _missing_message(model) -> str:
    path = Path(model.path)
    found = "has no config.json" if path.is_dir() else "does not exist"
    estimate = (
        f"; model.reference_config={model.reference_config} lets `--dry-run` estimate the memory without them"
        if model.reference_config
        else ""
    )
    return (
        f"model.path: {path} {found} on this machine ({socket.gethostname()}); vlmrun never downloads weights, "
        "and the job loads them from model.path on the machine it runs on: point model.path at a local "
        f"Hugging Face model directory with config.json{estimate}"
    )


#: A folder of tiny models every run on this machine may share (built once per family and seed, each
#: in a temp dir renamed into place): for many tiny runs in a row, the test suite's. Unset: each run
#: builds its own in <run dir>/cache/models. The models are the same either way (seeded).
SHARED_TINY_MODELS = "VLMRUN_TINY_MODELS"


def ensure_model(model, cache_dir: Path, seed: int) -> Path:
    """The model directory of `model` (the recipe's ModelConfig), building a tiny one on first use (in
    $VLMRUN_TINY_MODELS when it is set, else under `cache_dir`)."""
    check_model_source(model)
    if model.tiny:
        from vlmrun.models.tiny import ensure_tiny_model

        shared = os.environ.get(SHARED_TINY_MODELS)
        return ensure_tiny_model(model.family, Path(shared) if shared else Path(cache_dir) / "models", seed=seed)
    return Path(model.path)
