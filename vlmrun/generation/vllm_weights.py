"""Refit of a vLLM model from the policy's weights: the naming half of the `vllm` generation backend.

A vLLM model class takes a checkpoint's tensors through its own `load_weights(iterable of (name,
tensor))`, which maps Hugging Face names onto its parameters (several onto one where it fuses them:
q, k and v into `qkv_proj`, gate and up into `gate_up_proj`) and returns the names of the parameters
it filled. `refit_model` feeds it the buckets of `PolicyBackend.weights_for_refit` as they are drawn,
by the policy's own names (transformers' in-memory names, which vLLM's mapper also takes: checked for
each family against vLLM's real classes in tests/test_vllm_classes.py), and checks at the end that
every parameter of the engine was filled. Duck-typed: nothing here imports vllm.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any


def refit_model(model: Any, buckets: Iterable[Mapping[str, Any]]) -> set[str]:
    """Load every bucket of policy tensors into vLLM model `model` (one `load_weights` call per bucket,
    each bucket dropped before the next is drawn); returns the engine parameters filled. KeyError
    names the engine parameters no tensor filled."""
    filled: set[str] = set()
    for bucket in buckets:
        filled |= set(model.load_weights(iter(bucket.items())))
        del bucket
    if missing := sorted({name for name, _ in model.named_parameters()} - filled):
        raise KeyError(f"refit: {len(missing)} engine parameters were filled by no policy tensor, e.g. {missing[:3]}")
    return filled


def engine_targets(model: Any, tensors: Mapping[str, Any]) -> dict[str, set[str]]:
    """{policy name: the engine parameters its tensor filled}, one `load_weights` call per tensor: what
    the naming check reads (a tensor must fill exactly one parameter)."""
    return {name: set(model.load_weights(iter([(name, tensor)]))) for name, tensor in tensors.items()}
