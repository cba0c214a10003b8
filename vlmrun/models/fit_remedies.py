"""The recipe changes a memory-fit refusal may suggest: each is applied and estimated again by fit.py,
which names those that lower the estimate, lowest first. Light (no torch): the fit check runs at submit."""

from __future__ import annotations

from typing import Any

from vlmrun.config.backends import POLICY_BACKENDS


def candidate_changes(recipe) -> list[tuple[dict[str, Any], str]]:
    """(recipe changes, how the refusal names them) that may lower a GPU recipe's estimate, in the order
    they are tried (fit.py estimates each and keeps those that lower it)."""
    p, t, c, d, g = recipe.parallel, recipe.train, recipe.cluster, recipe.data, recipe.grpo
    grpo = t.algorithm == "grpo"
    out: list[tuple[dict[str, Any], str]] = [
        ({"parallel.fsdp": True}, "parallel.fsdp=true"),
        ({"parallel.reduce_every_micro_batch": True}, "parallel.reduce_every_micro_batch=true"),
        ({"parallel.cpu_offload": True}, "parallel.cpu_offload=true"),
        (
            {"parallel.dp": 2 * p.dp, "cluster.nodes": 2 * c.nodes},
            f"parallel.dp={2 * p.dp} with cluster.nodes={2 * c.nodes}",
        ),
        ({"parallel.activation_checkpointing": True}, "parallel.activation_checkpointing=true"),
        ({"parallel.mixed_precision": "bf16"}, "parallel.mixed_precision=bf16"),
    ]
    if "tp" in POLICY_BACKENDS[recipe.model.backend].capabilities.axes and p.dp % 2 == 0:
        # the same GPUs cut another way: each replica over twice the ranks, half the replicas
        out.insert(
            0,
            (
                {"parallel.tp": 2 * p.tp, "parallel.dp": p.dp // 2},
                f"parallel.tp={2 * p.tp} with parallel.dp={p.dp // 2}",
            ),
        )
        out.insert(
            1,
            (
                {"parallel.pp": 2 * p.pp, "parallel.dp": p.dp // 2},
                f"parallel.pp={2 * p.pp} with parallel.dp={p.dp // 2}",
            ),
        )
    if p.dp_shard and p.dp_shard < p.dp:  # HSDP: a larger shard group holds less per rank
        wider = 2 * p.dp_shard if p.dp % (2 * p.dp_shard) == 0 else p.dp
        out.insert(1, ({"parallel.dp_shard": wider}, f"parallel.dp_shard={wider}"))
    out += [
        ({"train.micro_batch_size": t.micro_batch_size // 2}, f"train.micro_batch_size={t.micro_batch_size // 2}"),
        ({"data.max_seq_len": d.max_seq_len // 2}, f"data.max_seq_len={d.max_seq_len // 2}"),
    ]
    if grpo and not recipe.generation.sleeps_between_uses:
        out.insert(1, ({"generation.release_weights": True}, "generation.release_weights=true"))
    if grpo and not p.offload_during_generation:
        out.insert(1, ({"parallel.offload_during_generation": True}, "parallel.offload_during_generation=true"))
    if grpo:
        out += [
            ({"grpo.kl_coef": 0.0}, "grpo.kl_coef=0"),
            ({"grpo.num_generations": g.num_generations // 2}, f"grpo.num_generations={g.num_generations // 2}"),
            ({"grpo.max_new_tokens": g.max_new_tokens // 2}, f"grpo.max_new_tokens={g.max_new_tokens // 2}"),
        ]
    return out
