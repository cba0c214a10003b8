"""GRPO's stages, named once, and the data-plane fields each writes and reads.

A step runs the stages in `STAGES` order; their names are the worker's stage methods' (`rollout`,
`logprob`, `train`; the controller runs `advantage`), the keys of the controller's stage timings and
of the row's `time_<stage>_s`. The fields are the plane's registry names (plane/fields.py):

    rollout    writes the prompts, responses, masks, generation logprobs, rewards and the family's
               inputs (per-token inputs and media), once, on the replica's owner rank
    logprob    reads the model inputs; writes prev logprobs (and ref logprobs under a KL penalty)
    advantage  reads the rewards; writes the advantages
    train      reads the model inputs and what the loss needs

The logprob and train stages read the same model inputs (the same media fields), so the policy sees
the same pixels in both and with one inner step every ratio is exactly 1.
"""

from __future__ import annotations

from enum import StrEnum

from vlmrun.plane.fields import family_inputs, in_registry_order
from vlmrun.plane.interface import PartitionSpec


class GrpoStage(StrEnum):
    ROLLOUT = "rollout"
    LOGPROB = "logprob"
    ADVANTAGE = "advantage"
    TRAIN = "train"


#: In the order a step runs them.
STAGES = tuple(GrpoStage)
#: The stages that read a step's partition (the rollout writes it).
CONSUMERS = (GrpoStage.LOGPROB, GrpoStage.ADVANTAGE, GrpoStage.TRAIN)


def stage_writes(stage: GrpoStage, family: str, *, kl: bool) -> tuple[str, ...]:
    """The fields `stage` writes for `family`, in registry order; `kl`: the run has a KL penalty."""
    written = {
        GrpoStage.ROLLOUT: (
            "prompt_ids",
            "response_ids",
            "response_mask",
            "generation_logprobs",
            "rewards",
            *family_inputs(family),
        ),
        GrpoStage.LOGPROB: ("prev_logprobs", "ref_logprobs") if kl else ("prev_logprobs",),
        GrpoStage.ADVANTAGE: ("advantages",),
        GrpoStage.TRAIN: (),
    }
    return in_registry_order(written[GrpoStage(stage)])


def stage_reads(stage: GrpoStage, family: str, *, kl: bool) -> tuple[str, ...]:
    """The fields `stage` reads for `family`, in registry order: the explicit list it asks the plane for."""
    model_inputs = ("prompt_ids", "response_ids", *family_inputs(family))
    loss = ("response_mask", "generation_logprobs", "prev_logprobs", "advantages", *(("ref_logprobs",) if kl else ()))
    read = {
        GrpoStage.ROLLOUT: (),
        GrpoStage.LOGPROB: model_inputs,
        GrpoStage.ADVANTAGE: ("rewards",),
        GrpoStage.TRAIN: (*model_inputs, *loss),
    }
    return in_registry_order(read[GrpoStage(stage)])


def partition_spec(family: str, *, kl: bool, num_samples: int) -> PartitionSpec:
    """The spec of a step's partition: what each consuming stage reads."""
    return PartitionSpec.reading({s: stage_reads(s, family, kl=kl) for s in CONSUMERS}, num_samples)
