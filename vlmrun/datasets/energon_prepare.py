"""Write Energon's `.nv-meta/` for a folder of WebDataset shards, as `energon prepare` would.

We call the same function the `energon prepare` CLI calls (`BaseWebdatasetFactory.
prepare_dataset`) and then write `dataset.yaml` the way the CLI does for `--sample-type
CrudeWebdataset`, adding `subflavors` (the CLI has no flag for them) so cookers can select our
samples. The result equals

    energon prepare DIR --non-interactive --split-parts 'train:train-[0-9]+\\.tar$' \\
        --split-parts 'val:val-[0-9]+\\.tar$' --sample-type CrudeWebdataset

plus one `subflavors:` entry in `dataset.yaml`.
"""

from __future__ import annotations

import contextlib
import io
import logging
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

#: The folder Energon reads its metadata from (`megatron.energon.flavors.webdataset.config`).
META_FOLDER = ".nv-meta"
_MAX_INDEX_WORKERS = 4


def prepare_crude_webdataset(folder: Path, *, split_patterns: dict[str, str], subflavors: dict[str, Any]) -> None:
    """Index every `*.tar` directly in `folder` and write `.nv-meta/` for a `CrudeWebdataset`.

    `split_patterns` maps a split part ("train", "val") to a regex that Energon matches against
    each shard name from its start. Writes `<shard>.tar.idx` next to each shard and, under
    `.nv-meta/`, `index.sqlite`, `index.uuid` (random: the only non-reproducible file),
    `.info.json`, `split.yaml` and `dataset.yaml`. Energon's indexer forks worker processes and
    prints to stdout; the output goes to this module's logger instead.
    """
    import yaml
    from megatron.energon.flavors.webdataset.base_webdataset import BaseWebdatasetFactory

    shards = sorted(p.name for p in folder.glob("*.tar"))
    if not shards:
        raise ValueError(f"no *.tar shards in {folder}")
    chatter = io.StringIO()
    with contextlib.redirect_stdout(chatter):
        BaseWebdatasetFactory.prepare_dataset(
            folder,
            shards,
            split_parts_patterns=list(split_patterns.items()),
            # The CLI passes None unless --shuffle-tars; shards keep their name order.
            shuffle_seed=None,
            workers=min(_MAX_INDEX_WORKERS, len(shards)),
        )
    logger.debug("energon prepare %s: %s", folder, chatter.getvalue().strip())
    dataset_definition = {
        "__module__": "megatron.energon",
        "__class__": "CrudeWebdataset",
        "subflavors": dict(subflavors),
    }
    with open(folder / META_FOLDER / "dataset.yaml", "w") as f:
        yaml.dump(dataset_definition, f, sort_keys=False)
