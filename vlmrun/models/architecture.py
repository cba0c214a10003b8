"""Which config.json describes a recipe's model, for estimates made before any weights are loaded.

In order: a tiny model's own config (vlmrun/models/reference/tiny_<family>.json, the config its
builder makes); the config.json in `model.path`, when it is readable and describes the family; else
the shipped architecture config that `model.reference_config` names (vlmrun/models/reference/<name>.json),
for a login node that does not see the weights or a placeholder model directory.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from vlmrun.errors import InputError
from vlmrun.models.params import Architecture, UnknownArchitecture, count_architecture

REFERENCE_DIR = Path(__file__).parent / "reference"
# model_type of a shipped reference config -> the recipe family it describes
_FAMILY_OF_TYPE = {"qwen2_5_vl": "qwen2_5_vl", "nemotron_h_omni": "nemotron_omni"}


@dataclass(frozen=True)
class ArchitectureSource:
    """An architecture, the config it was counted from and, for a fallback, why (printed with the estimate)."""

    architecture: Architecture
    source: str
    note: str = ""


def reference_names() -> list[str]:
    """The shipped reference configs, by the name `model.reference_config` takes."""
    return sorted(p.stem for p in REFERENCE_DIR.glob("*.json") if not p.stem.startswith("tiny_"))


def load_architecture(model) -> ArchitectureSource:
    """The architecture of `model` (the recipe's ModelConfig), from the first config that describes it.

    Raises UnknownArchitecture (saying why) when none does, and InputError on model.reference_config
    for a name that is not shipped or is of another family.
    """
    if model.tiny:
        name = f"tiny_{model.family}"
        return ArchitectureSource(_reference(name, model.family), _shown(name), "the tiny builder's config")
    why = _from_model_dir(Path(model.path), model.family)
    if isinstance(why, ArchitectureSource):
        return why
    if model.reference_config is None:
        raise UnknownArchitecture(f"{why}; set model.reference_config to one of {', '.join(reference_names())}")
    arch = _reference(model.reference_config, model.family)
    return ArchitectureSource(arch, _shown(model.reference_config), f"model.reference_config; {why}")


def _from_model_dir(path: Path, family: str) -> ArchitectureSource | str:
    config_file = path / "config.json"
    try:
        config = json.loads(config_file.read_text())
    except FileNotFoundError:
        return f"{config_file} does not exist"
    except (OSError, ValueError) as e:
        return f"{config_file} cannot be read ({type(e).__name__})"
    try:
        return ArchitectureSource(count_architecture(family, config), str(config_file))
    except UnknownArchitecture as e:
        return f"{config_file}: {e}"


def _reference(name: str, family: str) -> Architecture:
    path = REFERENCE_DIR / f"{name}.json"
    if not path.is_file():
        raise InputError("model.reference_config", name, f"choose one of {', '.join(reference_names())}")
    config = json.loads(path.read_text())
    described = _FAMILY_OF_TYPE.get(config.get("model_type"))
    if described != family:
        raise InputError("model.reference_config", name, f"it describes a {described} model, not model.family {family}")
    return count_architecture(family, config)


def _shown(name: str) -> str:
    return f"vlmrun/models/reference/{name}.json"
