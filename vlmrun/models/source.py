"""Where a run's model comes from: a local HF directory, or a tiny one built into the run's cache."""

from __future__ import annotations

from pathlib import Path

from vlmrun.errors import InputError


def ensure_model(model, cache_dir: Path, seed: int) -> Path:
    """`model` is the recipe's ModelConfig. Never downloads anything."""
    if model.tiny:
        from vlmrun.models.tiny import ensure_tiny_model

        return ensure_tiny_model(model.family, Path(cache_dir) / "models", seed=seed)
    path = Path(model.path)
    if not (path / "config.json").is_file():
        raise InputError("model.path", str(path), "must be a local Hugging Face model directory with config.json "
                         "(vlmrun never downloads weights)")
    return path
