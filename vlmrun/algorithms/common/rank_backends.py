"""A rank's policy and generation engine, opened from the recipe: the one way a run's rank (`RankWorker`)
and `vlmrun eval` open them, so what reaches the backends (the model's dtype and attention kernel,
the engine's compute dtype and the recipe's engine options, vLLM's included) cannot drift between the
two. Backends come from their factories (`open_policy`, `open_generator`); this module only says what
the recipe asks of them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from vlmrun.config.dtype import compute_dtype
from vlmrun.generation import open_generator
from vlmrun.models.spec import ModelSpec
from vlmrun.policy import open_policy

if TYPE_CHECKING:
    from vlmrun.config.parallel import ParallelConfig
    from vlmrun.generation.interface import GenerationBackend
    from vlmrun.policy.interface import PolicyBackend


def rank_threads(recipe, cpu_threads: int) -> int:
    """The CPU threads a rank computes with: a GPU recipe's rank its share of the node's CPUs
    (`cluster.threads_per_gpu_rank`: its host side, an offloaded optimizer step included, would crawl on
    one), a CPU rank the `cpu_threads` its CPU was given."""
    return recipe.cluster.threads_per_gpu_rank if recipe.cluster.gpus_per_node else cpu_threads


def open_rank_policy(
    recipe, model_dir: str, *, rank: int, world_size: int, parallel: ParallelConfig | None, gpus: bool
) -> PolicyBackend:
    """Rank `rank` of `world_size` of the recipe's policy over the model in `model_dir` (call `setup`
    next). `parallel`: the recipe's parallel section for a run's rank; None for the whole model in
    this one process, replicated (eval). `gpus`: the rank owns a GPU."""
    m = recipe.model
    return open_policy(
        m.backend,
        model=ModelSpec(
            directory=str(model_dir),
            dtype=m.dtype,
            attn_implementation=m.attn_implementation,
            lora=m.lora.model_dump() if m.lora is not None else None,
        ),
        rank=rank,
        world_size=world_size,
        train=recipe.train,
        parallel=parallel,
        gpus=gpus,
    )


def open_rank_engine(
    recipe, model_dir: str, *, replica: int = 0, gpus: bool, threads: int | None = None, policy_model=None
) -> GenerationBackend:
    """The recipe's generation engine of data-parallel replica `replica` (its sampling stream), in the
    compute dtype, on the rank's GPU (`gpus`: Ray made it cuda:0) or the CPU, with the recipe's engine
    options (call `setup` next). It reads no weights: every use refits it from the policy first; or,
    given `policy_model` (`PolicyBackend.generation_model`), it generates with that model itself."""
    m = recipe.model
    weights = {"weights": "policy", "policy_model": policy_model} if policy_model is not None else {"weights": "refit"}
    return open_generator(
        recipe.generation.backend,
        model=ModelSpec(
            directory=str(model_dir),
            dtype=compute_dtype(m.dtype, recipe.parallel.mixed_precision),
            attn_implementation=m.attn_implementation,
        ),
        replica=replica,
        device="cuda" if gpus else "cpu",
        threads=threads,
        **weights,
        options=recipe.generation.engine_options(max_model_len=recipe.data.max_seq_len + recipe.grpo.max_new_tokens),
    )
