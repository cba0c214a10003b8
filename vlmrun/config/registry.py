"""Registries of implementations by the name a recipe field gives (`model.backend`, `generation.backend`,
`train.algorithm`): each maps a name to "module:attribute", imported only when that name is chosen, so
choosing one never loads the others' heavy dependencies. A new implementation is a new entry."""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from typing import Any

from vlmrun.errors import InputError


def load_entry(registry: Mapping[str, str], name: str, field: str) -> Any:
    """The object `registry[name]` names, imported now. Raises InputError naming `field` (the recipe
    field that chose `name`) and the names there are, for a name the registry lacks."""
    if name not in registry:
        raise InputError(field, name, f"one of {', '.join(sorted(registry))}")
    module, _, attribute = registry[name].partition(":")
    return getattr(importlib.import_module(module), attribute)
