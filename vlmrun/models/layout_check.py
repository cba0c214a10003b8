"""What a tensor- or pipeline-parallel layout needs of the model itself, checked at submit.

The recipe alone cannot say whether `parallel.tp` splits the model: that takes its config (read where
the memory estimate reads it, models/architecture.py). megatron-core cuts the attention heads and the
key/value groups (query groups) into tp equal parts, the vocabulary (embedding and head) too, and the
decoder layers into pp equal stages (vlmrun's mapping: policy/megatron/mapping.py); a layout that does
not divide them is refused naming the field, before any job starts.
"""

from __future__ import annotations

from vlmrun.errors import InputError
from vlmrun.models.params import Architecture


def check_layout(recipe, arch: Architecture, source: str) -> None:
    """InputError naming parallel.tp or parallel.pp when the layout does not split `arch`'s heads, key/value heads,
    vocabulary (tp) or layers (pp)."""
    p = recipe.parallel
    if p.tp > 1 and arch.heads:
        for count, what in ((arch.heads, "attention heads"), (arch.kv_heads, "key/value heads (query groups)")):
            if count % p.tp:
                raise InputError(
                    "parallel.tp",
                    p.tp,
                    f"must divide the model's {count} {what} ({source}): each tensor-parallel rank holds "
                    f"whole heads; try parallel.tp={_largest_divisor(arch, p.tp)}",
                )
        if arch.vocab % p.tp:
            raise InputError(
                "parallel.tp",
                p.tp,
                f"must divide the model's vocabulary of {arch.vocab} ({source}): each rank holds 1/tp",
            )
    if p.pp > 1 and len(arch.layers) % p.pp:
        raise InputError(
            "parallel.pp",
            p.pp,
            f"must divide the model's {len(arch.layers)} decoder layers ({source}): each stage holds as many",
        )


def _largest_divisor(arch: Architecture, tp: int) -> int:
    """The largest tp below `tp` that divides the heads, the key/value heads and the vocabulary."""
    return next(t for t in range(tp - 1, 0, -1) if not (arch.heads % t or arch.kv_heads % t or arch.vocab % t))
