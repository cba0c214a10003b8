"""Config of generation: which engine samples responses (GRPO's rollouts) and validation's greedy answers."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from vlmrun.config.backends import GENERATION_BACKEND_NAMES
from vlmrun.config.section import Section


class VllmOptions(Section):
    """What a user tunes of the `vllm` engine (generation.vllm; vLLM's own names and meanings)."""

    gpu_memory_utilization: float = Field(
        0.5,
        gt=0,
        le=1,
        description="the fraction of the GPU the engine may take for its weights and KV cache while it "
        "generates (the policy's shards share the GPU: the memory check counts the rollout with it)",
    )
    max_model_len: int | None = Field(
        None, ge=1, description="the longest prompt + response; default data.max_seq_len + grpo.max_new_tokens"
    )
    max_num_seqs: int | None = Field(None, ge=1, description="sequences decoded at once; default vLLM's")
    enforce_eager: bool = Field(False, description="no CUDA graphs: less memory and a faster start, slower decoding")
    enable_prefix_caching: bool = Field(
        True, description="reuse the KV cache of a prompt shared by its responses (a GRPO group's)"
    )


class GenerationConfig(Section):
    """`backend` names the generation engine (`vlmrun.generation.open_generator`): `hf` is transformers'
    `generate` in the rank's own process, refit from the policy in memory, one bucket of weights at a
    time (`refit_bucket_mb`; not part of the run identity: the bucket size changes no number)."""

    backend: Literal[GENERATION_BACKEND_NAMES] = Field(
        "hf",
        description="the generation engine: hf (transformers generate, CPU or GPU), or vllm (vLLM's engine in "
        "the rank's process on its GPU; needs the vllm extra or the container's image)",
    )
    vllm: VllmOptions | None = Field(
        None, description="the vllm engine's settings (generation.backend: vllm; default: VllmOptions's defaults)"
    )
    release_weights: bool = Field(
        False,
        description="free the engine's weights after each rollout and validation pass (the next refit "
        "allocates them again): the training phases then run without the engine's copy of the model beside "
        "them, what a big model on one GPU needs (the memory check counts either way)",
    )
    refit_bucket_mb: int = Field(
        256,
        ge=1,
        le=1 << 16,
        description="refit streams the policy's weights into the engine in buckets of at most this many MB "
        "(a larger tensor goes alone): the memory a refit takes beyond the engine's own weights",
    )

    @property
    def sleeps_between_uses(self) -> bool:
        """Whether the engine frees its weights after each rollout and validation pass: asked for
        (release_weights), or vLLM's engine, which sleeps while the policy trains (level 2: weights and
        KV cache freed, refilled by the next refit)."""
        return self.release_weights or self.backend == "vllm"

    def engine_options(self, *, max_model_len: int) -> dict:
        """What the backend's engine is opened with (`open_generator(options=...)`): nothing for hf;
        vLLM's settings, `max_model_len` where the recipe leaves it unset."""
        if self.backend != "vllm":
            return {}
        options = (self.vllm or VllmOptions()).model_dump()
        options["max_model_len"] = options["max_model_len"] or max_model_len
        return {k: v for k, v in options.items() if v is not None}
