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
    enforce_eager: bool | None = Field(
        None,
        description="no CUDA graphs (GPU) or torch.compile (CPU): less memory and a faster start, slower decoding; "
        "default: false on a GPU, true on a CPU run (compiling takes longer than a CPU run decodes)",
    )
    enable_prefix_caching: bool = Field(
        True, description="reuse the KV cache of a prompt shared by its responses (a GRPO group's)"
    )
    kv_cache_memory_bytes: int | None = Field(
        None,
        ge=1 << 20,
        description="a CPU run's KV cache per engine, in bytes (default 1 GiB: the host's memory is every rank's "
        "and engine's); on a GPU the KV cache is what gpu_memory_utilization leaves, which the memory check counts",
    )
    env: str | None = Field(
        None,
        description="the engine's own environment (a folder built by tools/vllm_env/build.sh; `make vllm-cpu` / "
        "`make vllm-gpu` in a checkout); default $VLMRUN_VLLM_ENV, else the checkout's .vllm-cpu/ (CPU run) or "
        ".vllm/ (GPU run)",
    )


class GenerationConfig(Section):
    """`backend` names the generation engine (`vlmrun.generation.open_generator`): `hf` is transformers'
    `generate` in the rank's own process, refit from the policy in memory, one bucket of weights at a
    time (`refit_bucket_mb`; not part of the run identity: the bucket size changes no number)."""

    backend: Literal[GENERATION_BACKEND_NAMES] = Field(
        "hf",
        description="the generation engine: hf (transformers generate, CPU or GPU), or vllm (vLLM's engine in a "
        "process of its own beside each rank, on the rank's GPU or vLLM's CPU backend; its environment: "
        "generation.vllm.env)",
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
        (release_weights), or vLLM's engine, which on a GPU sleeps while the policy trains (level 2:
        weights and KV cache freed, refilled by the next refit; vLLM's CPU backend has no sleep mode and
        frees its memory only when asked: vlmrun/generation/vllm.py)."""
        return self.release_weights or self.backend == "vllm"

    def engine_options(self, *, max_model_len: int) -> dict:
        """What the backend's engine is opened with (`open_generator(options=...)`): nothing for hf; for
        vllm {"engine": vLLM's engine arguments (`max_model_len` where the recipe leaves it unset), "env":
        generation.vllm.env, "end_on_release": generation.release_weights (an engine without sleep mode
        then ends at each release: vlmrun/generation/vllm.py)}."""
        if self.backend != "vllm":
            return {}
        options = (self.vllm or VllmOptions()).model_dump()
        env = options.pop("env")
        options["max_model_len"] = options["max_model_len"] or max_model_len
        engine = {k: v for k, v in options.items() if v is not None}
        return {"engine": engine, "env": env, "end_on_release": self.release_weights}
