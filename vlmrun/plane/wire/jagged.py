"""Rows <-> the one torch.nested jagged tensor per field that crosses a backend.

Backends hand back what they stored in more than one form (docs/measurements.md): TransferQueue's simple storage
returns a jagged tensor, its Mooncake storage rebuilds one from per-sample values (strided when
jagged fails), and a dense per-sample field may come back stacked, as (N,) or as (N, L). `rows_of`
turns any of them into one 1-D row per sample, so adapters decode a single form.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from vlmrun.plane.wire.codec import WireError


def to_jagged(rows: Sequence[torch.Tensor | Sequence[torch.Tensor]]) -> torch.Tensor:
    """One nested jagged tensor of shape (len(rows), j): row i is `rows[i]`, a 1-D tensor or the 1-D
    pieces it is made of (wire/codec.py). All pieces are copied once into one buffer, nothing else."""
    if not rows:
        raise WireError("a jagged field needs at least one row")
    pieces = [[r] if isinstance(r, torch.Tensor) else list(r) for r in rows]
    flat = [p for row in pieces for p in row]
    if any(p.dim() != 1 for p in flat):
        raise WireError(f"jagged rows are 1-D, got shapes {[tuple(p.shape) for p in flat if p.dim() != 1][:3]}")
    if len({p.dtype for p in flat}) > 1:
        raise WireError(f"one jagged field has one dtype, got {sorted({str(p.dtype) for p in flat})}")
    lengths = torch.tensor([0] + [sum(p.numel() for p in row) for row in pieces], dtype=torch.int64)
    values = torch.cat(flat) if flat else torch.empty(0)
    return torch.nested.nested_tensor_from_jagged(values, offsets=lengths.cumsum(0))


def rows_of(value: Any, n: int, field: str = "") -> list[torch.Tensor]:
    """`n` 1-D rows from what a backend returned for one field of `n` samples."""
    if isinstance(value, torch.Tensor) and value.is_nested:
        rows = [r.reshape(-1) for r in value.unbind()]
    elif isinstance(value, torch.Tensor) and value.dim() == 1:
        rows = list(value.reshape(-1, 1).unbind())
    elif isinstance(value, torch.Tensor) and value.dim() >= 2:
        rows = [r.reshape(-1) for r in value.unbind()]
    elif isinstance(value, list | tuple) and all(isinstance(r, torch.Tensor) for r in value):
        rows = [r.reshape(-1) for r in value]
    else:
        raise WireError(f"{field}: a backend returned {type(value).__name__}, not tensors")
    if len(rows) != n:
        raise WireError(f"{field}: a backend returned {len(rows)} rows for {n} samples")
    return rows
