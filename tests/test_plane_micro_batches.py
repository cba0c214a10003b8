"""SFT v2's micro-batches through the local plane: exact round trip, record ids and sample ids kept."""

from __future__ import annotations

import pytest
import torch

from vlmrun.config.families import FAMILIES
from vlmrun.data.batch import Batch
from vlmrun.plane.local import LocalDataPlane
from vlmrun.plane.micro_batches import get_micro_batches, put_micro_batches


def _batch(family: str, ids: list[str], width: int, images: int) -> Batch:
    spec = FAMILIES[family]
    n = len(ids)
    media = {}
    if images:
        grid = (
            torch.tensor([[1, 2, 4]] * images)
            if spec.media_keys[1] == "image_grid_thw"
            else torch.tensor([[2, 4]] * images)
        )
        media = {"pixel_values": torch.randn(8 * images, 12), spec.media_keys[1]: grid}
    return Batch(
        sample_ids=ids,
        input_ids=torch.randint(0, 100, (n, width)),
        attention_mask=torch.ones(n, width, dtype=torch.long),
        labels=torch.full((n, width), -100),
        media=media,
        token_inputs={k: torch.zeros(n, width, dtype=torch.long) for k in spec.token_keys},
    )


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_micro_batches_round_trip_exactly(family):
    batches = [_batch(family, ["a", "b"], 7, images=3), _batch(family, ["c"], 4, images=0)]
    plane = LocalDataPlane()
    record_ids = put_micro_batches(plane, "step-3", batches, family)
    got = get_micro_batches(plane, "step-3", record_ids, family)
    plane.clear("step-3")
    assert plane.partitions() == [] and plane.state_dict() == {}
    for g, b in zip(got, batches, strict=True):
        assert g.sample_ids == b.sample_ids and g.media.keys() == b.media.keys()
        for name in ("input_ids", "attention_mask", "labels"):
            assert torch.equal(getattr(g, name), getattr(b, name))
        for k in b.media:
            assert torch.equal(g.media[k], b.media[k]) and g.media[k].dtype == b.media[k].dtype
        for k in b.token_inputs:
            assert torch.equal(g.token_inputs[k], b.token_inputs[k])
