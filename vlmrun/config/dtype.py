"""The recipe's dtype names (`model.dtype`) and the torch dtypes they stand for: the one place that maps them.

No import of torch until a dtype is asked for, so the CLI and `vlmrun submit --dry-run` stay light.
"""

from __future__ import annotations

from typing import Any

#: The names a recipe may give (`model.dtype`), in the spelling of torch's attributes.
DTYPES = ("float32", "bfloat16")


def torch_dtype(name: str) -> Any:
    """The torch dtype of a recipe dtype name; ValueError for a name outside DTYPES."""
    if name not in DTYPES:
        raise ValueError(f"unknown dtype {name!r}; allowed: {', '.join(DTYPES)}")
    import torch

    return getattr(torch, name)


def compute_dtype(model_dtype: str, mixed_precision: str) -> str:
    """The dtype a rank computes in: bf16 under `parallel.mixed_precision: bf16`, else the weights' own
    (`model.dtype`). A generation engine holds its weights in it."""
    return "bfloat16" if mixed_precision == "bf16" else model_dtype
