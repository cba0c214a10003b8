"""Which config.json describes a recipe's model, for estimates made before any weights are loaded.

In order: a tiny model's own config (vlmrun/models/reference/tiny_<family>.json, the config its
builder makes: `model.tiny` trains that model, so a `model.reference_config` beside it is not what
runs, and the estimate says so); the config.json in `model.path`, when it is readable and describes
the family (one of another family is refused, naming model.family); else the shipped architecture
config that `model.reference_config` names (vlmrun/models/reference/<name>.json), for a login node
that does not see the weights (a dry run needs no model.path there) or a placeholder model directory.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from vlmrun.config.families import family_of_model_type
from vlmrun.errors import InputError
from vlmrun.models.params import Architecture, UnknownArchitecture, count_architecture
from vlmrun.models.source import check_model_family, read_model_config

REFERENCE_DIR = Path(__file__).parent / "reference"


@dataclass(frozen=True)
class ArchitectureSource:
    """An architecture, the config it was counted from and, for a fallback, why (printed with the estimate);
    `warning`: a recipe field this estimate did not use, and why."""

    architecture: Architecture
    source: str
    note: str = ""
    warning: str | None = None


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
        unused = None
        if model.reference_config is not None:
            unused = (
                f"model.reference_config={model.reference_config} is not used: model.tiny trains the tiny "
                f"{model.family} model, and this estimates it; to estimate {model.reference_config}, set "
                "model.path instead (a dry run does not need the directory on this machine)"
            )
        return ArchitectureSource(_reference(name, model.family), _shown(name), "the tiny builder's config", unused)
    why = _from_model_dir(Path(model.path), model.family)
    if isinstance(why, ArchitectureSource):
        return why
    if model.reference_config is None:
        raise UnknownArchitecture(f"{why}; set model.reference_config to one of {', '.join(reference_names())}")
    arch = _reference(model.reference_config, model.family)
    return ArchitectureSource(arch, _shown(model.reference_config), f"model.reference_config; {why}")


def _from_model_dir(path: Path, family: str) -> ArchitectureSource | str:
    config_file = path / "config.json"
    config = read_model_config(path)
    if config is None:
        return f"{config_file} does not exist on this machine (a submit needs the weights at model.path)"
    check_model_family(family, config, config_file)
    try:
        return ArchitectureSource(count_architecture(family, config), str(config_file))
    except UnknownArchitecture as e:
        return f"{config_file}: {e}"


def _reference(name: str, family: str) -> Architecture:
    path = REFERENCE_DIR / f"{name}.json"
    if not path.is_file():
        raise InputError("model.reference_config", name, f"choose one of {', '.join(reference_names())}")
    config = json.loads(path.read_text())
    described = family_of_model_type(config.get("model_type"))
    if described != family:
        raise InputError("model.reference_config", name, f"it describes a {described} model, not model.family {family}")
    return count_architecture(family, config)


def _shown(name: str) -> str:
    return f"vlmrun/models/reference/{name}.json"
