"""Generation: sample G responses per prompt with log-probs (GRPO), greedy answers (validation), new
weights from the policy.

`interface.py` is the seam (`GenerationBackend`, `SamplingParams`); `rollouts.py` the record it returns;
`prompts.py` selects prompts of a `PromptBatch` with their media; `hf.py` the transformers backend (one
replica in this process), `vllm.py` the rank's handle on vLLM's engine, which runs in a process of its
own on vLLM's torch (`vllm_engine.py`; `vllm_wire.py`: a refit's shared segment; `vllm_env.py`: the
engine's environment).

`open_generator` is the one way to get a backend (keyed on the recipe's `generation.backend`); no
module outside `vlmrun.generation` imports a backend module (an import-linter contract in
pyproject.toml). A new backend is a new entry in `BACKENDS`. Importing this package loads no torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from vlmrun.config.backends import GENERATION_BACKENDS, entries
from vlmrun.config.registry import load_entry

if TYPE_CHECKING:
    from vlmrun.generation.interface import GenerationBackend
    from vlmrun.models.spec import ModelSpec

#: generation.backend -> "module:class" of its GenerationBackend (config/backends.py names them).
BACKENDS = entries(GENERATION_BACKENDS)


def open_generator(
    backend: str,
    *,
    model: ModelSpec,
    replica: int = 0,
    device: str = "cpu",
    threads: int | None = None,
    weights: str = "load",
    options: dict | None = None,
    policy_model: Any = None,
) -> GenerationBackend:
    """Replica `replica` of the `backend` engine in this process, on `device` (call `setup` next).

    `model` is its architecture and where its weights come from (a directory, or a config for random
    init); its dtype is the engine's. `weights="load"` reads them at `setup`; `weights="refit"` reads
    none: the engine is built without them and gets them from its first `load_weights` (a policy
    refit; `generate` before it is refused), so a training rank never holds a second whole copy from
    disk, in host memory or on its GPU, before it needs one. `weights="policy"` (hf only) generates with
    `policy_model` (`PolicyBackend.generation_model`) itself: no copy at all (interface.py, 6).
    `threads` caps torch's CPU threads.
    `options` are the engine's own settings (`GenerationConfig.engine_options`: vLLM's; none for hf).
    Raises InputError naming `generation.backend` for a backend that is not in BACKENDS.
    """
    if weights not in ("load", "refit", "policy"):
        raise ValueError(f"open_generator: weights={weights!r}, allowed: load, refit, policy")
    if (weights == "policy") != (policy_model is not None) or (weights == "policy" and backend != "hf"):
        raise ValueError("open_generator: weights='policy' takes a policy_model, and the hf backend")
    extra = {"options": options} if options else {}
    if policy_model is not None:
        extra["policy_model"] = policy_model
    cls = load_entry(BACKENDS, backend, "generation.backend")
    return cls(
        model=model, replica=replica, device=device, threads=threads, weights_from_refit=weights == "refit", **extra
    )
