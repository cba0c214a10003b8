"""The base of every recipe section: the typing rules that hold for every field, present and future.

1. Unknown keys are refused (`extra="forbid"`), so a typo is named instead of ignored.
2. Types are strict: a boolean is not a number (`true` is not 1), a number is not a boolean, a
   string is not a number (YAML already turns `3` and `1e-3` into numbers, so only a quoted value
   meets this). An int is still a valid float.
3. Floats are finite: `.inf`, `-.inf` and `.nan` are refused. A recipe is written back to
   recipe.yaml and sent to the ranks as JSON, where they would not survive the trip.
4. YAML has no tuples: a list given for a tuple field becomes one, its items still strict.
"""

from __future__ import annotations

import typing
from typing import Any

from pydantic import BaseModel, ConfigDict, ValidationInfo, field_validator


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)

    @field_validator("*", mode="before")
    @classmethod
    def _yaml_list_as_tuple(cls, value: Any, info: ValidationInfo) -> Any:
        field = cls.model_fields.get(info.field_name or "")
        if isinstance(value, list) and field is not None and typing.get_origin(field.annotation) is tuple:
            return tuple(value)
        return value
