"""Reference loader: plain WebDataset + torch DataLoader with our cooker and encoder, for comparison.

It reads the same shards sequentially, cooks samples with the same cooker (same image decode),
encodes and collates them with the same `ConversationEncoder`, and shuffles with a buffer of the
same size. It has none of the Energon loader's guarantees (no savable state, no sharding across
data-parallel ranks, a different sample order), so it is only a yardstick: `vlmrun bench-loader`
runs it side by side with the Energon loader.
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Iterator
from pathlib import Path

from vlmrun.data.batch import Batch

logger = logging.getLogger(__name__)


def reference_loader(recipe, *, processor_dir: str, split: str, num_workers: int) -> Iterator[Batch]:
    """Endless `Batch`es of `recipe.train.micro_batch_size` samples from `split` of `recipe.data.path`."""
    import webdataset as wds
    from torch.utils.data import DataLoader

    from vlmrun.config.families import family_spec
    from vlmrun.data.chat_encoding import ConversationEncoder
    from vlmrun.data.cookers import COOK_FUNCTIONS
    from vlmrun.data.loader import load_processor
    from vlmrun.data.splits import split_shards

    d, t = recipe.data, recipe.train
    urls = [str(Path(d.path) / name) for name, _ in split_shards(d.path, split)]
    encoder = ConversationEncoder(
        load_processor(processor_dir, recipe.family), family_spec(recipe.family), d.max_seq_len
    )
    cook = COOK_FUNCTIONS[d.cookers[0]]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # webdataset warns about defaults we set on purpose
        pipeline = wds.WebDataset(
            urls,
            shardshuffle=len(urls),
            repeat=True,
            seed=t.seed,
            workersplitter=wds.split_by_worker,
            empty_check=False,
        )
    if d.shuffle_buffer > 1:
        pipeline = pipeline.shuffle(d.shuffle_buffer, seed=t.seed)
    pipeline = pipeline.map(lambda raw: _encode_or_skip(encoder, cook, raw)).select(lambda e: e is not None)
    pipeline = pipeline.batched(t.micro_batch_size, collation_fn=encoder.collate, partial=False)
    loader = DataLoader(
        pipeline,
        batch_size=None,
        num_workers=num_workers,
        persistent_workers=num_workers > 0,
        prefetch_factor=2 if num_workers else None,
    )
    while True:
        yield from loader


def _encode_or_skip(encoder, cook, raw: dict):
    """The encoded sample, or None (skipped, like the Energon loader skips it) when it is malformed."""
    from vlmrun.data.cookers import MalformedSample

    try:
        return encoder.encode(cook({**raw, "__restore_key__": ()}))
    except MalformedSample as e:
        logger.warning("reference loader: skipped corrupt sample %s", e)
        return None
