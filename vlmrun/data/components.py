"""Data-component registry: which cookers and task encoders exist, and which model families they serve.

Light on purpose (no torch, no Energon, no transformers): `vlmrun submit --dry-run` calls
`check_components` on a login node. The implementations live in `cookers.py` and `task_encoder.py`
and are looked up by the names declared here; tests/test_data_families.py checks that both agree.
The families themselves are one registry in vlmrun/config/families.py.

A `ComponentSpec` is a cooker or task encoder: its name, a version that goes into the loader
fingerprint (bump it when the component would produce different samples), and the families it
supports. A cooker also says which Energon subflavors it cooks (the format vlmrun's data sets write:
vlmrun/datasets/formats.py); a task encoder says which `train.algorithm` it feeds (conversations
with labels for SFT, prompts for GRPO; None: any).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from types import MappingProxyType

from vlmrun.config.families import FAMILIES, family_spec
from vlmrun.datasets.formats import CONVERSATION_SUBFLAVORS
from vlmrun.errors import InputError


@dataclass(frozen=True, kw_only=True)
class ComponentSpec:
    name: str
    version: int
    families: tuple[str, ...]
    subflavors: dict[str, str] = field(default_factory=dict)
    algorithm: str | None = None

    @property
    def tag(self) -> str:
        """`name@version`, as it appears in the loader fingerprint."""
        return f"{self.name}@{self.version}"


# the conversation cooker and the chat task encoders serve every family (tests/test_data_encoding.py runs each)
_CHAT_FAMILIES = tuple(FAMILIES)

COOKERS = MappingProxyType(
    {
        "conversation": ComponentSpec(
            name="conversation",
            version=1,
            families=_CHAT_FAMILIES,
            subflavors=dict(CONVERSATION_SUBFLAVORS),
        ),
    }
)

TASK_ENCODERS = MappingProxyType(
    {
        "chat_sft": ComponentSpec(name="chat_sft", version=1, families=_CHAT_FAMILIES, algorithm="sft"),
        "chat_grpo": ComponentSpec(name="chat_grpo", version=1, families=_CHAT_FAMILIES, algorithm="grpo"),
    }
)


def check_components(recipe) -> None:
    """Refuse a recipe whose cookers or task encoder are unknown or do not support its family.

    `recipe` is a `vlmrun.config.recipe.Recipe`. Raises `InputError` naming the field
    (`data.cookers` or `data.task_encoder`), the bad value and the supported families or names, or
    the task encoders that feed the recipe's `train.algorithm`.
    """
    family = recipe.family
    family_spec(family)
    if not recipe.data.cookers:
        raise InputError("data.cookers", [], f"name at least one cooker; known: {', '.join(COOKERS)}")
    for name in recipe.data.cookers:
        _check_one("data.cookers", name, COOKERS, family)
    encoder = _check_one("data.task_encoder", recipe.data.task_encoder, TASK_ENCODERS, family)
    algorithm = recipe.train.algorithm
    if encoder.algorithm not in (None, algorithm):
        fitting = ", ".join(n for n, s in TASK_ENCODERS.items() if s.algorithm == algorithm)
        raise InputError(
            "data.task_encoder",
            encoder.name,
            message=f"data.task_encoder: {encoder.name!r} feeds train.algorithm {encoder.algorithm!r}, "
            f"this recipe trains {algorithm!r}: use {fitting}",
        )


def _check_one(field_path: str, name: str, registry, family: str) -> ComponentSpec:
    spec = registry.get(name)
    if spec is None:
        raise InputError(field_path, name, f"known: {', '.join(registry)}")
    if family not in spec.families:
        supported = ", ".join(spec.families)
        raise InputError(
            field_path,
            name,
            message=f"{field_path}: {name!r} does not support family {family!r}; it supports: {supported}",
        )
    return spec
