"""What a GRPO rank reports to the controller after each stage (the worker's return values).

Small records: sample ids, rewards, lengths and timings. The bulk tensors stay in the data plane,
except on the driver path (`data_plane.enabled: false`), where the rollout's rows and the logprob
stage's columns come back here. `plane` is {"seconds", "bytes"} the rank's plane client moved in the stage.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from vlmrun.algorithms.grpo.rollout_rows import RolloutRows
from vlmrun.data.batch import SampleCounts
from vlmrun.policy.interface import StepResult


@dataclass
class RolloutReport:
    """Stage 1 on a replica's owner rank: its prompts and every response's score."""

    prompts: list[str]  # prompt sample ids; this and every per-prompt or per-response list below but
    # sample_ids leave out the fillers (data/epochs.py), which count in no metric
    templates: list[str]  # each prompt's question template ("" where none)
    sample_ids: list[str]  # response sample ids, prompt-major
    rewards: list[float]
    correct: list[bool]
    well_formed: list[bool]
    lengths: list[int]  # response tokens, end-of-turn included
    generated_tokens: int  # tokens the generation batch ran (padding included)
    times: dict[str, float]  # loader, refit, generation, reward
    loader_counts: SampleCounts | None = None  # the owned loader shard's totals (None: the driver's)
    plane: dict[str, float] = field(default_factory=dict)
    rows: RolloutRows | None = None  # the driver path: the rollout itself
    reward_parts: list[dict[str, float]] = field(default_factory=list)  # each response's terms (grpo.rewards)


def kept(values: list, keep: list[bool]) -> list:
    """The `values` whose `keep` is True, in order (a rollout report leaves fillers out: data/epochs.py)."""
    return [v for v, k in zip(values, keep, strict=True) if k]


@dataclass
class LogprobReport:
    """Stage 2 on a rank: how long the logprobs took; on the driver path the columns themselves."""

    times: dict[str, float]  # logprob
    plane: dict[str, float] = field(default_factory=dict)
    columns: dict[str, list] | None = None  # prev_logprobs (and ref_logprobs), driver path only


@dataclass
class TrainReport:
    """Stage 3 on a rank: one `StepResult` per inner step (identical on every rank)."""

    results: list[StepResult]
    times: dict[str, float]  # train
    plane: dict[str, float] = field(default_factory=dict)
