"""Where a run's model comes from: a local HF directory, or a tiny one built into the run's cache."""

from __future__ import annotations

from pathlib import Path

from vlmrun.errors import InputError


def check_model_source(model) -> None:
    """A `model.path` must be a local Hugging Face directory with config.json (tiny models are built).

    `model` is the recipe's ModelConfig. Reads the filesystem only (fast on a login node); raises
    InputError on model.path.
    """
    if model.tiny:
        return
    path = Path(model.path)
    if not (path / "config.json").is_file():
        found = "has no config.json" if path.is_dir() else "does not exist"
        raise InputError(
            "model.path",
            str(path),
            message=f"model.path: {path} {found}; vlmrun never downloads "
            "weights: point model.path at a local Hugging Face model directory with config.json",
        )


def ensure_model(model, cache_dir: Path, seed: int) -> Path:
    """The model directory of `model` (the recipe's ModelConfig), building a tiny one on first use."""
    check_model_source(model)
    if model.tiny:
        from vlmrun.models.tiny import ensure_tiny_model

        return ensure_tiny_model(model.family, Path(cache_dir) / "models", seed=seed)
    return Path(model.path)
