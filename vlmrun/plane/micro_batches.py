"""SFT v2's micro-batches through the plane: one record per micro-batch (fields.py).

A micro-batch's padded tensors travel as per-record fields (`batch_input_ids`, ...), its packed media
as one segment per media field (none for a text-only micro-batch), and its sample ids in the record's
tags. The loader's side writes the records, the train stage (`SFT_TRAIN`) reads all of them. The
round trip is exact, so SFT v1 and v2 keep identical losses.
"""

from __future__ import annotations

from collections.abc import Sequence

from vlmrun.config.families import family_spec
from vlmrun.data.batch import Batch
from vlmrun.plane.interface import DataPlane, PartitionSpec

_SAMPLE_IDS_TAG = "sample_ids"
#: The stage that consumes the records.
SFT_TRAIN = "sft_train"


def record_fields(family: str) -> tuple[str, ...]:
    """The fields of one micro-batch's record for `family`."""
    spec = family_spec(family)
    padded = ("input_ids", "attention_mask", "labels", *spec.token_keys)
    return (*(f"batch_{k}" for k in padded), *spec.media_keys)


def put_micro_batches(plane: DataPlane, partition: str, batches: Sequence[Batch], family: str) -> list[str]:
    """Register `partition` and write one record per micro-batch; returns the record ids, in order."""
    spec = family_spec(family)
    plane.register(partition, PartitionSpec.reading({SFT_TRAIN: record_fields(family)}, len(batches)))
    ids = [f"mb-{k}" for k in range(len(batches))]
    columns = {
        "batch_input_ids": [b.input_ids for b in batches],
        "batch_attention_mask": [b.attention_mask for b in batches],
        "batch_labels": [b.labels for b in batches],
        **{f"batch_{k}": [b.token_inputs[k] for b in batches] for k in spec.token_keys},
        **{k: [[b.media[k]] if k in b.media else [] for b in batches] for k in spec.media_keys},
    }
    plane.put(partition, ids, columns, tags=[{_SAMPLE_IDS_TAG: list(b.sample_ids)} for b in batches])
    return ids


def get_micro_batches(plane: DataPlane, partition: str, record_ids: Sequence[str], family: str) -> list[Batch]:
    """The micro-batches `put_micro_batches` wrote as `record_ids`, in that order."""
    spec = family_spec(family)
    got = plane.get(partition, record_ids, plane.spec(partition).stage_fields(SFT_TRAIN))
    return [
        Batch(
            sample_ids=list(got.tags[i][_SAMPLE_IDS_TAG]),
            input_ids=got["batch_input_ids"][i],
            attention_mask=got["batch_attention_mask"][i],
            labels=got["batch_labels"][i],
            media={k: got[k][i][0] for k in spec.media_keys if got[k][i]},
            token_inputs={k: got[f"batch_{k}"][i] for k in spec.token_keys},
        )
        for i in range(len(got))
    ]
