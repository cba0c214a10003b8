"""One metrics row of a GRPO step (run/rows.py): the run contract's keys (as SFT's) and GRPO's own
(`GrpoStats`), computed here as follows.

    reward, accuracy, format_rate         mean reward, exact-match rate, well-formed rate of the responses
    accuracy/<template>                   exact-match rate per question template (CLEVR's count_all, ...)
    probs_ratio_min, probs_ratio_max      over every trained token: exactly 1 with one inner step
    token_mult_prob_error                 mean exp(|generation logprob - prev logprob|) per token
    sampling_importance_ratio             mean exp(prev - generation logprob) per token
    gen_kl_error, kl, clip_fraction       k3 KL of generation from policy; k3 KL to the reference; clipped ratios
    advantage_mean/min/max                over the step's responses
    response_length_mean/max              response tokens, end-of-turn included
    time_<stage>_s                        rollout (= loader + refit + generation + reward + plane), generation,
                                          refit, reward, logprob, advantage, train, data_plane (refit with
                                          parallel.offload_during_generation: the policy's moves too)
    time_plane_<stage>_s                  the data plane's part of rollout, logprob, advantage (the controller), train;
                                          advantage_beside: all of the controller's, beside the ranks' logprobs
    data_plane_fraction, plane_bytes      plane seconds / step seconds; bytes put and got, all processes
    generation_tokens_per_s               tokens the generation batches ran / the slowest replica's seconds

Ranks and replicas run each stage side by side, so a stage's time is the slowest rank's; the data
plane's time is the sum over stages of the slowest rank's plane time, plus what of the controller's the
step waited for: the advantage stage runs beside the ranks' logprob compute (stages.py), so only what
outlasts the slowest rank's compute and reads counts.
`loss` and `grad_norm` are the means over the inner steps, `lr` the first's, `valid_tokens` the sum.
A filler prompt (data/epochs.py) and its responses count in none of them (its responses train no token).
"""

from __future__ import annotations

from collections import defaultdict

from vlmrun.algorithms.grpo.fields import GrpoStage
from vlmrun.algorithms.grpo.loss import SUMMED
from vlmrun.algorithms.grpo.stages import StepRecord
from vlmrun.data.batch import SampleCounts
from vlmrun.data.epochs import is_filler
from vlmrun.policy.interface import StepResult
from vlmrun.run.rows import GrpoStats, StepRow


def step_row(
    record: StepRecord, *, step: int, attempt: int, epoch: int, step_s: float, counters: dict, counts: SampleCounts
) -> StepRow:
    """The row of `step`; `counters` already count this step, `counts` are the loaders' totals."""
    results = record.trains[0].results  # identical on every rank
    tokens = sum(r.valid_tokens for r in results)
    prompts = [p for r in record.rollouts for p in r.prompts]
    return StepRow(
        step=step,
        attempt=attempt,
        epoch=epoch,
        loss=sum(r.loss for r in results) / len(results),
        grad_norm=sum(r.grad_norm for r in results) / len(results),
        lr=results[0].lr,
        valid_tokens=tokens,
        consumed_samples=counters["consumed_samples"],
        dropped_samples=counts.dropped,
        truncated_samples=counts.truncated,
        sample_ids=prompts,
        step_time_s=round(step_s, 4),
        loader_latency_max_s=round(record.loader_s, 4),
        tokens_per_s=round(tokens / step_s, 2),
        samples_per_s=round(len(prompts) / step_s, 2),
        peak_rss_mb=max(r.peak_rss_mb for t in record.trains for r in t.results),
        grpo=_stats(record, results, tokens, step_s),
    )


def _stats(record: StepRecord, results: list[StepResult], tokens: int, step_s: float) -> GrpoStats:
    rewards = [x for r in record.rollouts for x in r.rewards]
    correct = [x for r in record.rollouts for x in r.correct]
    lengths = [x for r in record.rollouts for x in r.lengths]
    gen_s = max(r.times["generation"] for r in record.rollouts)
    stats = _inner_stats(results)
    means = {_mean_name(k): stats[k] / max(tokens, 1) for k in SUMMED}
    plane_s, plane_bytes, plane_stages = _plane(record)
    slowest = {k: max(r.times[k] for r in record.rollouts) for k in ("generation", "refit", "reward")}
    advantages = _real_advantages(record)
    n = max(1, len(rewards))  # a step of fillers alone (data/epochs.py) has no response to count
    return GrpoStats(
        reward=sum(rewards) / n,
        accuracy=sum(correct) / n,
        format_rate=sum(x for r in record.rollouts for x in r.well_formed) / n,
        accuracy_by_template=_by_template(record),
        probs_ratio_min=stats["probs_ratio_min"],
        probs_ratio_max=stats["probs_ratio_max"],
        **means,
        advantage_mean=float(advantages.mean()),
        advantage_min=float(advantages.min()),
        advantage_max=float(advantages.max()),
        response_length_mean=sum(lengths) / n,
        response_length_max=max(lengths, default=0),
        time_rollout_s=round(record.walls[GrpoStage.ROLLOUT], 4),
        **{f"time_{k}_s": round(v, 4) for k, v in slowest.items()},
        time_logprob_s=round(record.walls[GrpoStage.LOGPROB], 4),
        time_advantage_s=round(record.walls[GrpoStage.ADVANTAGE], 4),
        time_train_s=round(record.walls[GrpoStage.TRAIN], 4),
        time_data_plane_s=round(plane_s, 4),
        plane_stage_s={k: round(v, 4) for k, v in plane_stages.items()},
        data_plane_fraction=round(plane_s / step_s, 4),
        plane_bytes=plane_bytes,
        generation_tokens_per_s=round(sum(r.generated_tokens for r in record.rollouts) / max(gen_s, 1e-9), 1),
        reward_parts=_reward_parts(record),
    )


def _real_advantages(record: StepRecord):
    """The step's advantages (response order, replica by replica) less the fillers' (all where only fillers)."""
    real = [not is_filler(i) for r in record.rollouts for i in r.sample_ids]
    return record.advantages[real] if any(real) else record.advantages


def _reward_parts(record: StepRecord) -> dict[str, float]:
    """The mean over the step's responses of each reward term and named number (grpo.rewards)."""
    parts = [p for r in record.rollouts for p in r.reward_parts]
    keys = sorted({k for p in parts for k in p})
    return {k: sum(p[k] for p in parts if k in p) / max(1, sum(k in p for p in parts)) for k in keys}


def _mean_name(key: str) -> str:
    return "clip_fraction" if key == "clipped" else key


def _inner_stats(results: list[StepResult]) -> dict[str, float]:
    out = {k: sum(r.stats[k] for r in results) for k in SUMMED}
    out["probs_ratio_min"] = min(r.stats["probs_ratio_min"] for r in results)
    out["probs_ratio_max"] = max(r.stats["probs_ratio_max"] for r in results)
    return out


def _by_template(record: StepRecord) -> dict[str, float]:
    hits: dict[str, list[bool]] = defaultdict(list)
    for r in record.rollouts:
        if not r.prompts:  # a replica that drew fillers alone (data/epochs.py)
            continue
        group = len(r.correct) // len(r.prompts)
        for i, ok in enumerate(r.correct):
            hits[r.templates[i // group] or "none"].append(ok)
    return {t: sum(v) / len(v) for t, v in sorted(hits.items())}


def _plane(record: StepRecord) -> tuple[float, int, dict[str, float]]:
    """(seconds, bytes, seconds per stage) of the data plane in one step (module doc)."""
    stages = {str(GrpoStage.ADVANTAGE): record.controller_plane.get("seconds", 0.0)}
    if record.controller_plane_beside:
        stages["advantage_beside"] = record.controller_plane_beside
    moved = record.controller_plane.get("bytes", 0)
    by_stage = {GrpoStage.ROLLOUT: record.rollouts, GrpoStage.LOGPROB: record.logprobs, GrpoStage.TRAIN: record.trains}
    for stage, reports in by_stage.items():
        stages[str(stage)] = max((r.plane.get("seconds", 0.0) for r in reports), default=0.0)
        moved += sum(r.plane.get("bytes", 0) for r in reports)
    return sum(v for k, v in stages.items() if k != "advantage_beside"), int(moved), stages
