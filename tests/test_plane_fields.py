"""The field registry and GRPO's stages (algorithms/grpo/fields.py): every GRPO stage asks for an
explicit list, and the policy sees the same media in the logprob stage as in the train stage."""

from __future__ import annotations

import pytest

from vlmrun.algorithms.grpo.fields import STAGES, GrpoStage, partition_spec, stage_reads, stage_writes
from vlmrun.config.families import FAMILIES
from vlmrun.plane.fields import FIELDS, Alignment, field_spec, media_fields
from vlmrun.plane.interface import DataPlaneError, PartitionSpec


def test_registry_names_the_grpo_fields():
    written = {f for s in STAGES for f in stage_writes(s, "qwen2_5_vl", kl=True)}
    read = {f for s in STAGES for f in stage_reads(s, "qwen2_5_vl", kl=True)}
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
        assert name in written and name in read and field_spec(name).doc
    with pytest.raises(KeyError, match="unknown data-plane field 'all'"):
        field_spec("all")


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_media_fields_are_the_familys(family):
    assert set(media_fields(family)) == set(FAMILIES[family].media_keys)
    assert all(FIELDS[f].alignment is Alignment.MEDIA for f in media_fields(family))
    assert FIELDS["pixel_values"].dtype == "policy"


@pytest.mark.parametrize("kl", [False, True])
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_logprob_and_train_stages_fetch_the_same_media(family, kl):
    media = {s: [f for f in stage_reads(s, family, kl=kl) if FIELDS[f].alignment is Alignment.MEDIA] for s in GrpoStage}
    assert media[GrpoStage.LOGPROB] == media[GrpoStage.TRAIN] == list(media_fields(family))
    # and the same model inputs: the logprobs that train compares against saw what train sees
    inputs = list(stage_reads(GrpoStage.LOGPROB, family, kl=kl))
    assert set(inputs) <= set(stage_reads(GrpoStage.TRAIN, family, kl=kl))
    for key in FAMILIES[family].token_keys:
        assert key in inputs


@pytest.mark.parametrize("kl", [False, True])
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_every_field_a_grpo_stage_reads_is_written_by_an_earlier_stage(family, kl):
    written: set[str] = set()
    for stage in STAGES:
        assert set(stage_reads(stage, family, kl=kl)) <= written, stage
        written |= set(stage_writes(stage, family, kl=kl))
    assert stage_writes(GrpoStage.LOGPROB, family, kl=False) == ("prev_logprobs",)
    assert stage_writes(GrpoStage.LOGPROB, family, kl=True) == ("prev_logprobs", "ref_logprobs")
    assert stage_writes(GrpoStage.ADVANTAGE, family, kl=kl) == ("advantages",)


def test_another_familys_fields_stay_out():
    assert "image_grid_hw" not in stage_reads(GrpoStage.TRAIN, "qwen2_5_vl", kl=False)
    assert "mm_token_type_ids" not in stage_reads(GrpoStage.TRAIN, "nemotron_omni", kl=False)
    assert not {f for f in stage_reads(GrpoStage.TRAIN, "qwen2_5_vl", kl=True) if f.startswith("batch_")}


def test_partition_spec_checks_its_fields_against_the_registry():
    spec = partition_spec("qwen2_5_vl", kl=True, num_samples=8)
    consumers = (GrpoStage.LOGPROB, GrpoStage.ADVANTAGE, GrpoStage.TRAIN)
    assert set(spec.fields) == {f for s in consumers for f in stage_reads(s, "qwen2_5_vl", kl=True)}
    assert spec.stage_fields(GrpoStage.ADVANTAGE) == ("rewards",)
    assert PartitionSpec.from_dict(spec.to_dict()) == spec
    with pytest.raises(DataPlaneError, match="unknown field"):
        PartitionSpec(fields=("prompt_ids", "logits"), num_samples=2, reads={"train": ("prompt_ids", "logits")})
    with pytest.raises(DataPlaneError, match="lacks"):
        PartitionSpec(fields=("rewards",), num_samples=2, reads={"advantage": ("rewards",), "train": ("advantages",)})
    with pytest.raises(DataPlaneError, match="read by none"):
        PartitionSpec(fields=("rewards", "prev_logprobs"), num_samples=2, reads={"advantage": ("rewards",)})
    with pytest.raises(DataPlaneError, match="read no field"):
        PartitionSpec(fields=("rewards",), num_samples=2, reads={"advantage": ("rewards",), "rollout": ()})
