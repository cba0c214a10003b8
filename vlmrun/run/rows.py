"""The metrics row: one optimizer step as metrics.jsonl stores it, filled by every algorithm's controller.

`StepRow` holds the keys every row carries; a GRPO row adds its `GrpoStats`, and a validation step its
`Validation`. `to_json` gives the flat JSON object users read; its key names are the run's contract;
`NUMBER_KEYS` are the keys readers check for numbers or null (run/metrics.py). Standard library only.

Every row carries:

    step, attempt, epoch                  the optimizer step (from 1), the attempt index, the data epoch
    loss                                  summed NLL / the step's global valid tokens (GRPO: the clipped
                                          policy-gradient loss over the response tokens)
    grad_norm                             before clipping
    lr                                    the LR this step's update used
    valid_tokens                          global label tokens of the step (GRPO: response tokens)
    consumed_samples                      samples trained on so far, all replicas (GRPO: prompts)
    dropped_samples, truncated_samples    samples the loader shards skipped (unfit under data.on_bad_sample:
                                          drop, or corrupt) and SFT conversations they cut, so far
    sample_ids                            the ids trained on in this step, every replica (no filler's)
    step_time_s, loader_latency_max_s     the step's wall time; the slowest replica's wait for its batches
    tokens_per_s, samples_per_s           throughput of the step
    peak_rss_mb                           the largest rank process (with its children)
    time                                  Unix time when the row was made

At validation steps (`Validation`): val_loss (null when the pass scored no token), val_accuracy,
val_samples, val_tokens, val_majority_baseline (always giving the most common answer), val_dropped_samples
and val_samples_requested (train.val_samples; more than val_samples when the split ran out first).

GRPO rows (`GrpoStats`, algorithms/grpo/metrics.py fills them): reward, accuracy, accuracy/<template>,
format_rate, probs_ratio_min/max, token_mult_prob_error, sampling_importance_ratio, gen_kl_error, kl,
clip_fraction, advantage_mean/min/max, response_length_mean/max, time_<stage>_s (rollout, generation,
refit, reward, logprob, advantage, train, data_plane), time_plane_<stage>_s (and advantage_beside: the
controller's plane time beside the ranks' compute), data_plane_fraction, plane_bytes,
generation_tokens_per_s; with grpo.rewards, reward/<name> (each term's mean) and reward/<name>/<key>
(the named numbers a user's function returned).
"""

from __future__ import annotations

import dataclasses
import time
import types
import typing
from dataclasses import dataclass, field


@dataclass(frozen=True, kw_only=True)
class Validation:
    """A validation pass over `val_samples` val samples, every rank's share summed."""

    val_loss: float | None  # summed NLL / val_tokens; None when the pass scored no token
    val_accuracy: float | None  # exact-match rate of the greedy answers; None when nothing was answered
    val_samples: int  # answered prompts: every one asked for, unless the val split ran out first
    val_tokens: int  # label tokens the NLL summed over (0: no token was scored, e.g. every label cut away)
    val_majority_baseline: float  # accuracy of always giving the most common answer
    val_dropped_samples: int = 0  # val samples left out (unfit under data.on_bad_sample: drop)
    val_samples_requested: int = 0  # train.val_samples (or eval's --samples): more than val_samples when short


@dataclass(frozen=True, kw_only=True)
class GrpoStats:
    """GRPO's keys (algorithms/grpo/metrics.py says how each is computed). `accuracy_by_template` goes
    out as `accuracy/<template>`, `plane_stage_s` as `time_plane_<stage>_s`, `reward_parts` (the mean of
    each of grpo.rewards' terms and their named numbers) as `reward/<name>`."""

    reward: float
    accuracy: float
    format_rate: float
    accuracy_by_template: dict[str, float]
    probs_ratio_min: float
    probs_ratio_max: float
    kl: float
    token_mult_prob_error: float
    sampling_importance_ratio: float
    gen_kl_error: float
    clip_fraction: float
    advantage_mean: float
    advantage_min: float
    advantage_max: float
    response_length_mean: float
    response_length_max: int
    time_rollout_s: float
    time_generation_s: float
    time_refit_s: float
    time_reward_s: float
    time_logprob_s: float
    time_advantage_s: float
    time_train_s: float
    time_data_plane_s: float
    plane_stage_s: dict[str, float]
    data_plane_fraction: float
    plane_bytes: int
    generation_tokens_per_s: float
    reward_parts: dict[str, float] = field(default_factory=dict)  # grpo.rewards' terms: reward/<name>

    def to_json(self) -> dict:
        out: dict = {}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if f.name == "accuracy_by_template":
                out |= {f"accuracy/{t}": v for t, v in value.items()}
            elif f.name == "plane_stage_s":
                out |= {f"time_plane_{k}_s": v for k, v in value.items()}
            elif f.name == "reward_parts":
                out |= {f"reward/{k}": v for k, v in value.items()}
            else:
                out[f.name] = value
        return out


@dataclass(frozen=True, kw_only=True)
class StepRow:
    """One optimizer step: the keys of every row (the module doc)."""

    step: int
    attempt: int
    epoch: int
    loss: float
    grad_norm: float
    lr: float
    valid_tokens: int
    consumed_samples: int
    dropped_samples: int = 0  # samples the loaders left out since the run began (data.on_bad_sample: drop)
    truncated_samples: int = 0  # SFT conversations cut to data.max_seq_len, media and a label kept
    sample_ids: list[str]
    step_time_s: float
    loader_latency_max_s: float
    tokens_per_s: float
    samples_per_s: float
    peak_rss_mb: float
    grpo: GrpoStats | None = None
    time: float = field(default_factory=lambda: round(time.time(), 3))
    validation: Validation | None = None

    def with_validation(self, validation: Validation | None) -> StepRow:
        return dataclasses.replace(self, validation=validation)

    def to_json(self) -> dict:
        """The row as metrics.jsonl and wandb take it: one flat object, GRPO's and validation's keys inline."""
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name not in _PARTS}
        if self.grpo is not None:
            out |= self.grpo.to_json()
        out["time"] = self.time
        if self.validation is not None:
            out |= dataclasses.asdict(self.validation)
        return out


_PARTS = ("grpo", "time", "validation")  # written after the common keys, in this order


def _number_keys(*classes: type) -> tuple[str, ...]:
    """The fields of `classes` whose values are numbers (or None: "not measured")."""
    keys = []
    for cls in classes:
        for name, hint in typing.get_type_hints(cls).items():
            args = set(typing.get_args(hint)) if isinstance(hint, types.UnionType) else {hint}
            if args - {type(None)} <= {int, float}:
                keys.append(name)
    return tuple(keys)


#: Every key of a row whose value is a number (null allowed: "not measured"); step and attempt among them.
NUMBER_KEYS = _number_keys(StepRow, GrpoStats, Validation)
