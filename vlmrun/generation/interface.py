"""The generation seam: what any generation engine offers the GRPO loop, one instance per replica or group.

Algorithms call only these methods and attributes; a backend (`hf`, `vllm`) implements them, and
`vlmrun.generation.open_generator` opens one (keyed on `generation.backend`).

1. `setup` loads the model; it returns {replica, params, image_token_id}, and sets `eos_ids`, the
   tokens that end a response (a reward's format check asks whether a response ended with one).
2. `generate` samples `n` responses to every prompt of a left-padded `PromptBatch` (the validation
   and GRPO prompt encoders make it) and returns `Rollouts`: prompt-major rows with the response
   ids, a response mask and the log-prob of every sampled token under the raw logits, so they equal
   what a teacher-forced training forward (`vlmrun.policy.loss.token_logprobs`) of the same weights
   gives. Suppressed tokens, temperature and top-p shape only the sampling distribution.
3. Sampling is seeded: the first call with a `SamplingParams.seed` starts the replica's stream for
   that seed, later calls with the same seed continue it; `state_dict` holds the stream's position,
   so a run resumed from a checkpoint samples the same responses as one that never stopped.
4. `load_weights` takes the policy's weights by parameter name: one mapping, or the buckets of
   `PolicyBackend.weights_for_refit` as they are drawn, copied into the engine's own tensors (in its
   dtype, on its device) bucket by bucket, so a refit holds one bucket beyond the engine's weights.
   Every weight of the engine must come exactly once (a tied weight, one tensor under several names,
   under any one of them: the policy sends it once); `weights_dtype` is the dtype it holds them in.
5. `release_weights` frees the weights' memory between uses (`generation.release_weights`); the next
   `load_weights` allocates them again, and `generate` before it is refused.
6. An engine that `reads_policy_weights` has no weights of its own: it generates with the policy's
   model itself (a sharded one gathers a layer at a time, as its forward does), so a refit gives it
   nothing, and each `generate` is collective over the policy's ranks: every rank calls it as often.
"""

from __future__ import annotations

import abc
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from vlmrun.data.batch import PromptBatch
    from vlmrun.generation.rollouts import Rollouts


@dataclass(frozen=True, kw_only=True)
class SamplingParams:
    """How responses are drawn. `temperature=0` is greedy; `top_p=1` keeps every token (no top-k ever)."""

    temperature: float = 1.0
    top_p: float = 1.0
    max_new_tokens: int = 32
    seed: int = 0

    def __post_init__(self):
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0 (0 = greedy), got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")


class GenerationBackend(abc.ABC):
    """A generation engine; see the module docstring for the contract."""

    @abc.abstractmethod
    def setup(self) -> dict[str, Any]:
        """Load the model; returns {replica, params, image_token_id} (of the first replica for a group)."""

    @abc.abstractmethod
    def generate(self, prompts: PromptBatch, sampling: SamplingParams, *, n: int) -> Rollouts:
        """`n` sampled responses to every prompt; row i*n + g of the result is response g to prompt i."""

    #: The recipe dtype name (`model.dtype` spelling) the engine holds its weights in: what a refit
    #: asks the policy for.
    weights_dtype: str = "float32"

    #: The token ids that end a response (the model's end-of-turn tokens); set by `setup`.
    eos_ids: Sequence[int] = ()

    #: The engine generates with the policy's own model (module doc).
    reads_policy_weights: bool = False

    @abc.abstractmethod
    def load_weights(self, weights: Mapping[str, Any] | Iterable[Mapping[str, Any]]) -> None:
        """Replace every weight by the tensor of the same name: one mapping of them all, or buckets of
        them (each consumed before the next is drawn). KeyError names a weight that came twice, that
        the engine lacks, or that never came; ValueError a shape that differs."""

    def refit_targets(self) -> Mapping[str, Any] | None:
        """The engine's own weight tensors by name, allocated, for a policy to write a refit straight
        into (`PolicyBackend.weights_for_refit(into=...)`); None: it copies each bucket it is given."""
        return None

    @abc.abstractmethod
    def release_weights(self) -> None:
        """Free the memory of every weight until the next `load_weights` (module doc)."""

    @abc.abstractmethod
    def state_dict(self) -> dict[str, Any]:
        """The sampling streams' state, for a checkpoint (tensors, ints, None; weights_only-loadable)."""

    @abc.abstractmethod
    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what `state_dict` returned."""

    @abc.abstractmethod
    def shutdown(self) -> None:
        """Release the model (and actors); the instance is unusable afterwards."""
