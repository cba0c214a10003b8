"""The training data of a loop: the one place a loop opens a loader shard."""

from __future__ import annotations


def open_train_shard(
    recipe, model_dir: str, *, shard: int, num_shards: int, placement_hash: str, loader_format: int | None = None
):
    """Loader shard `shard` of `num_shards` over `data.split`, its processor from `model_dir`, stamped
    with the run's placement, reading the stream of the run's `loader_format` (None: the current one);
    a rank that owns its replica's shard and a driver-fed loop open it alike."""
    from vlmrun.data.loader import open_loader_shard

    return open_loader_shard(
        recipe,
        processor_dir=model_dir,
        shard=shard,
        num_shards=num_shards,
        placement_hash=placement_hash,
        split=recipe.data.split,
        **({} if loader_format is None else {"loader_format": loader_format}),
    )
