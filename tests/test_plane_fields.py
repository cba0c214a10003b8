"""The field registry: every GRPO stage asks for an explicit list, and the policy sees the same media
in the logprob stages as in the train stage."""

from __future__ import annotations

import pytest

from vlmrun.config.families import FAMILIES
from vlmrun.plane.fields import (
    FIELDS,
    GRPO_STAGES,
    Alignment,
    Stage,
    field_spec,
    media_fields,
    partition_fields,
    stage_fields,
    stage_writes,
)
from vlmrun.plane.interface import DataPlaneError, PartitionSpec

GRPO_CONSUMERS = (Stage.PREV_LOGPROB, Stage.REF_LOGPROB, Stage.ADVANTAGE, Stage.TRAIN)


def test_registry_names_the_grpo_fields():
    for name in (
        "prompt_ids",
        "response_ids",
        "response_mask",
        "generation_logprobs",
        "prev_logprobs",
        "ref_logprobs",
        "rewards",
        "advantages",
    ):
        spec = field_spec(name)
        assert spec.writers and spec.readers and spec.doc
    with pytest.raises(KeyError, match="unknown data-plane field 'all'"):
        field_spec("all")


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_media_fields_are_the_familys(family):
    assert set(media_fields(family)) == set(FAMILIES[family].media_keys)
    assert all(FIELDS[f].alignment is Alignment.MEDIA for f in media_fields(family))
    assert FIELDS["pixel_values"].dtype == "policy"


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_logprob_and_train_stages_fetch_the_same_media(family):
    media = {s: [f for f in stage_fields(s, family) if FIELDS[f].alignment is Alignment.MEDIA] for s in Stage}
    assert media[Stage.PREV_LOGPROB] == media[Stage.REF_LOGPROB] == media[Stage.TRAIN] == list(media_fields(family))
    # and the same model inputs: the logprobs that train compares against saw what train sees
    inputs = [f for f in stage_fields(Stage.PREV_LOGPROB, family)]
    assert inputs == list(stage_fields(Stage.REF_LOGPROB, family))
    assert set(inputs) <= set(stage_fields(Stage.TRAIN, family))
    for key in FAMILIES[family].token_keys:
        assert key in inputs


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_every_field_a_grpo_stage_reads_is_written_by_an_earlier_stage(family):
    written: set[str] = set()
    for stage in GRPO_STAGES:
        assert set(stage_fields(stage, family)) <= written, stage
        written |= set(stage_writes(stage, family))
    assert stage_writes(Stage.PREV_LOGPROB, family) == ("prev_logprobs",)
    assert stage_writes(Stage.ADVANTAGE, family) == ("advantages",)


def test_another_familys_fields_stay_out():
    assert "image_grid_hw" not in stage_fields(Stage.TRAIN, "qwen2_5_vl")
    assert "mm_token_type_ids" not in stage_fields(Stage.TRAIN, "nemotron_omni")
    assert not {f for f in stage_fields(Stage.TRAIN, "qwen2_5_vl") if f.startswith("batch_")}


def test_partition_spec_checks_its_fields_against_the_registry():
    spec = PartitionSpec.for_stages("qwen2_5_vl", GRPO_CONSUMERS, 8)
    assert spec.fields == partition_fields("qwen2_5_vl", GRPO_CONSUMERS)
    assert spec.stage_fields(Stage.ADVANTAGE) == ("rewards",)
    assert PartitionSpec.from_dict(spec.to_dict()) == spec
    with pytest.raises(DataPlaneError, match="unknown field"):
        PartitionSpec(fields=("prompt_ids", "logits"), num_samples=2, consumers=("train",))
    with pytest.raises(DataPlaneError, match="lacks"):
        PartitionSpec(fields=("rewards",), num_samples=2, consumers=("advantage", "train"))
    with pytest.raises(DataPlaneError, match="read by none"):
        PartitionSpec(fields=("rewards", "prev_logprobs"), num_samples=2, consumers=("advantage",))
    with pytest.raises(ValueError):
        PartitionSpec(fields=("rewards",), num_samples=2, consumers=("rollout",))
