"""One GRPO step as the controller dispatches it (algorithms/grpo/stages.py) and the row it makes of it
(grpo/metrics.py, run/rows.py), in-process: the ranks and the replicas' partitions stood in for.

Both ways of moving a step's samples run the same stages on the same ranks: the plane way tells the
ranks whether the advantages were written (also when writing them failed, so no rank waits for word
that never comes); the driver way hands every stage exactly the fields the field registry gives it.
The advantages are group-normalized per replica; the row averages the inner steps, takes each stage's
slowest rank and counts the plane's bytes and the seconds the step waited for. That every data-plane
setting gives the same numbers on real runs: tests/test_grpo_e2e.py.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from vlmrun.algorithms.grpo import stages
from vlmrun.algorithms.grpo.fields import GrpoStage
from vlmrun.algorithms.grpo.metrics import step_row
from vlmrun.algorithms.grpo.partition import split_fields, stage_fields
from vlmrun.algorithms.grpo.reports import LogprobReport, RolloutReport, TrainReport
from vlmrun.algorithms.grpo.rollout_rows import RolloutRows
from vlmrun.algorithms.grpo.stages import DriverStages, PlaneStages
from vlmrun.config.load import load_recipe
from vlmrun.data.batch import SampleCounts
from vlmrun.distributed.topology import Role, plan_placement
from vlmrun.plane.interface import SampleBatch
from vlmrun.policy.interface import StepResult
from vlmrun.run.rows import NUMBER_KEYS, GrpoStats, StepRow, Validation

GRPO = Path(__file__).resolve().parents[1] / "recipes" / "tiny-grpo-cpu.yaml"
G = 2  # responses per prompt
REWARDS = {0: [1.0, 1.0, 0.5, 0.5], 1: [0.0, 0.0, 1.0, 0.0]}  # replica -> rewards of its 2 prompts x G


@pytest.fixture
def recipe():
    return load_recipe(GRPO, [f"grpo.num_generations={G}", "train.global_batch_size=4", "train.micro_batch_size=1"])


@pytest.fixture(autouse=True)
def gather_values(monkeypatch):
    """The stand-in ranks answer with values, not Ray object refs: what `gather` would return."""
    monkeypatch.setattr(stages, "gather", list)


def result(loss: float, lr: float = 0.1, **stats) -> StepResult:
    base = dict.fromkeys(("kl", "token_mult_prob_error", "sampling_importance_ratio", "gen_kl_error", "clipped"), 0.0)
    base |= {"probs_ratio_min": 1.0, "probs_ratio_max": 1.0} | stats
    return StepResult(loss=loss, grad_norm=2 * loss, lr=lr, valid_tokens=10, compute_s=0.1, peak_rss_mb=5.0, stats=base)


def rollout_report(shard: int, rows: RolloutRows | None = None) -> RolloutReport:
    prompts = [f"p{shard}-{i}" for i in range(2)]
    return RolloutReport(
        prompts=prompts,
        templates=["count_all", "exists"],
        sample_ids=[f"{p}#{g}" for p in prompts for g in range(G)],
        rewards=REWARDS[shard],
        correct=[r == 1.0 for r in REWARDS[shard]],
        well_formed=[True] * 4,
        lengths=[3, 4, 5, 6],
        generated_tokens=24,
        times={"loader": 0.01 * (shard + 1), "refit": 0.02, "generation": 0.3, "reward": 0.001},
        loader_counts=SampleCounts(dropped=shard),
        plane={"seconds": 0.05, "bytes": 1000},
        rows=rows,
    )


class Ranks:
    """A worker group of dp=2 ranks answering in this process; records every stage call and its kwargs."""

    def __init__(self, recipe, rows_of=None):
        self.plan = plan_placement(recipe.parallel.layout)
        self.calls: list[tuple[str, int, dict]] = []
        self.rows_of = rows_of  # the driver path: shard -> the rollout's rows

    def _answer(self, method: str, rank: int, kwargs: dict):
        self.calls.append((method, rank, kwargs))
        shard = next(s.shard for s in self.plan.shards if rank in s.delivery_ranks)
        if method == "rollout":
            return rollout_report(shard, self.rows_of(shard) if self.rows_of else None)
        if method == "logprob":
            columns = {"prev_logprobs": [torch.full((2,), -float(rank)) for _ in kwargs["sample_ids"]]}
            return LogprobReport(times={"logprob": 0.2 + rank}, plane={"seconds": 0.1, "bytes": 10}, columns=columns)
        if method == "train":
            return TrainReport([result(1.0), result(3.0, lr=0.05, probs_ratio_min=0.9)], {"train": 0.5}, {"bytes": 5})
        return None  # advantages_written

    def replica_owners(self, method, per_shard):
        return [self._answer(method, s.owner_rank, per_shard(s.shard)) for s in self.plan.shards]

    submit_replica_owners = replica_owners

    def replicas(self, method, per_shard, role=Role.OWNER):
        """Every rank of each replica runs `method`; the `role` rank's answer, in shard order."""
        answers = [{r: self._answer(method, r, per_shard(s.shard)) for r in s.delivery_ranks} for s in self.plan.shards]
        return [by_rank[s.rank_of(role)] for s, by_rank in zip(self.plan.shards, answers, strict=True)]

    def by_dp(self, method, parts):
        return [self._answer(method, r, parts[s.shard]) for s in self.plan.shards for r in s.delivery_ranks]

    submit_by_dp = by_dp

    def called(self, method: str) -> list[tuple[int, dict]]:
        return [(rank, kw) for m, rank, kw in self.calls if m == method]


class Partitions:
    """The replicas' partitions as the controller reaches them (ReplicaPlanes): rewards in, advantages out."""

    def __init__(self, fail: bool = False):
        self.fail, self.put = fail, []

    def get_each(self, partitions, sample_ids, fields):
        if self.fail:
            raise RuntimeError("the plane went away")
        assert fields == ["rewards"]
        return [
            SampleBatch(list(ids), {"rewards": [torch.tensor(r) for r in REWARDS[k]]})
            for k, ids in enumerate(sample_ids)
        ]

    def put_each(self, partitions, sample_ids, columns):
        self.put.append((partitions, columns))

    def take(self):
        return {"seconds": 0.4, "bytes": 100}


def test_the_plane_way_runs_each_stage_on_its_ranks_and_writes_group_normalized_advantages(recipe):
    ranks, planes = Ranks(recipe), Partitions()
    record = PlaneStages(recipe, ranks, planes, micro_batches_per_replica=2).run(step=7)
    assert [m for m, _, _ in ranks.calls] == ["rollout"] * 2 + ["logprob"] * 2 + ["advantages_written"] * 2 + [
        "train"
    ] * 2
    assert [rank for rank, _ in ranks.called("rollout")] == [s.owner_rank for s in ranks.plan.shards]
    assert all(kw == {"step": 7, "n_micro": 2} for _, kw in ranks.called("rollout"))
    for (rank, kw), (_, train) in zip(ranks.called("logprob"), ranks.called("train"), strict=True):
        assert kw["sample_ids"] == rollout_report(rank).sample_ids == train["sample_ids"]  # each rank its replica's
    assert all(kw == {"step": 7, "ok": True} for _, kw in ranks.called("advantages_written"))
    ((partitions, columns),) = planes.put
    assert len(set(partitions)) == 2 and all("7" in p for p in partitions)  # the step's partition of each replica
    written = [torch.stack(c["advantages"]) for c in columns]  # no spread in a group: no signal
    assert torch.equal(written[0], torch.zeros(4))
    assert torch.allclose(written[1], torch.tensor([0.0, 0.0, 1.0, -1.0]), atol=1e-5)
    assert torch.equal(record.advantages, torch.cat(written))
    assert torch.equal(record.advantages, torch.cat([torch.stack(c["advantages"]) for c in columns]))
    assert set(record.walls) == {"rollout", "logprob", "advantage", "train"} and record.loader_s == 0.02
    assert record.controller_plane["bytes"] == 100 and record.controller_plane_beside == 0.4
    assert 0.0 <= record.controller_plane["seconds"] <= 0.4  # only what outlasted the ranks' compute


def test_a_failed_advantage_stage_still_tells_the_ranks_and_fails_the_step(recipe):
    ranks = Ranks(recipe)
    with pytest.raises(RuntimeError, match="the plane went away"):
        PlaneStages(recipe, ranks, Partitions(fail=True), micro_batches_per_replica=2).run(step=3)
    assert all(kw == {"step": 3, "ok": False} for _, kw in ranks.called("advantages_written"))
    assert len(ranks.called("advantages_written")) == 2 and not ranks.called("train")  # no rank waits in vain


def all_rows(recipe, shard: int) -> RolloutRows:
    """A replica's rollout with a value for every field a stage reads (as the owner rank returns it)."""
    prompt_fields, response_fields = split_fields(
        sorted({f for s in (GrpoStage.LOGPROB, GrpoStage.TRAIN) for f in stage_fields(recipe, s)} | {"rewards"})
    )
    report = rollout_report(shard)
    prompts = SampleBatch(report.prompts, {f: [torch.ones(2)] * 2 for f in prompt_fields})
    responses = {f: [torch.ones(2)] * 4 for f in response_fields if f not in ("prev_logprobs", "advantages")}
    responses["rewards"] = [torch.tensor(r) for r in REWARDS[shard]]
    return RolloutRows(prompts, SampleBatch(report.sample_ids, responses))


def test_the_driver_way_hands_each_stage_exactly_its_fields(recipe):
    ranks = Ranks(recipe, rows_of=lambda shard: all_rows(recipe, shard))
    loaders = {s.shard: FakeLoader() for s in ranks.plan.shards}
    record = DriverStages(recipe, ranks, loaders, micro_batches_per_replica=2).run(step=5)
    assert all(len(kw["prompts"]) == 2 for _, kw in ranks.called("rollout"))  # its shard's micro-batches
    for stage, method in ((GrpoStage.LOGPROB, "logprob"), (GrpoStage.TRAIN, "train")):
        prompt_fields, response_fields = split_fields(stage_fields(recipe, stage))
        for _, kw in ranks.called(method):
            assert sorted(kw["rows"].prompts.columns) == sorted(prompt_fields), method
            assert sorted(kw["rows"].responses.columns) == sorted(response_fields), method
    trained = dict(ranks.called("train"))
    owner = ranks.plan.shards[1].owner_rank
    got = trained[owner]["rows"].responses.columns
    assert all(torch.equal(p, torch.full((2,), -float(owner))) for p in got["prev_logprobs"])  # its replica's logprobs
    assert torch.allclose(torch.stack(got["advantages"]), torch.tensor([0.0, 0.0, 1.0, -1.0]), atol=1e-5)
    assert record.rollouts[0].rows is None  # the record keeps the reports, not the rollout
    assert record.loader_s >= 0 and set(record.walls) == {"rollout", "logprob", "advantage", "train"}


class FakeLoader:
    def next_batch(self):
        return object()


def test_the_row_of_a_step_averages_the_inner_steps_and_takes_each_stage_s_slowest_rank(recipe):
    ranks = Ranks(recipe)
    record = PlaneStages(recipe, ranks, Partitions(), micro_batches_per_replica=2).run(step=2)
    row = step_row(
        record, step=2, attempt=1, epoch=0, step_s=2.0, counters={"consumed_samples": 8}, counts=SampleCounts(3, 1)
    )
    assert (row.loss, row.grad_norm, row.lr, row.valid_tokens) == (2.0, 4.0, 0.1, 20)  # means; the first's lr; sum
    assert row.sample_ids == ["p0-0", "p0-1", "p1-0", "p1-1"] and row.consumed_samples == 8
    assert (row.dropped_samples, row.truncated_samples) == (3, 1)
    g = row.grpo
    assert g.probs_ratio_min == 0.9 and g.probs_ratio_max == 1.0
    assert g.reward == sum(REWARDS[0] + REWARDS[1]) / 8 and g.accuracy == 3 / 8
    assert g.accuracy_by_template == {"count_all": 2 / 4, "exists": 1 / 4}  # the prompts' templates, per response
    assert g.response_length_mean == 4.5 and g.response_length_max == 6 and g.generation_tokens_per_s == 48 / 0.3
    # the plane: each stage's slowest rank, the controller's waited share; bytes of every process
    stage_s = g.plane_stage_s
    assert (stage_s["rollout"], stage_s["logprob"], stage_s["train"]) == (0.05, 0.1, 0.0)
    assert g.time_data_plane_s == round(0.05 + 0.1 + stage_s["advantage"], 4) and stage_s["advantage_beside"] == 0.4
    assert g.plane_bytes == 100 + 2 * 1000 + 2 * 10 + 2 * 5


def test_a_row_is_one_flat_json_object_with_the_contract_s_keys():
    grpo = GrpoStats(
        **{
            f: 0.5
            for f in GrpoStats.__dataclass_fields__
            if f not in ("accuracy_by_template", "plane_stage_s", "reward_parts")
        },
        accuracy_by_template={"count_all": 0.25},
        plane_stage_s={"rollout": 0.1},
        reward_parts={"brief": 0.75, "brief/words": 3.0},
    )
    row = StepRow(
        step=3,
        attempt=0,
        epoch=0,
        loss=1.0,
        grad_norm=1.0,
        lr=0.1,
        valid_tokens=4,
        consumed_samples=8,
        sample_ids=["a"],
        step_time_s=0.1,
        loader_latency_max_s=0.0,
        tokens_per_s=40.0,
        samples_per_s=80.0,
        peak_rss_mb=1.0,
        grpo=grpo,
    )
    val = Validation(val_loss=None, val_accuracy=0.5, val_samples=2, val_tokens=0, val_majority_baseline=0.5)
    out = json.loads(json.dumps(row.with_validation(val).to_json()))
    assert out["accuracy/count_all"] == 0.25 and out["time_plane_rollout_s"] == 0.1 and out["val_loss"] is None
    assert out["reward/brief"] == 0.75 and out["reward/brief/words"] == 3.0 and "reward_parts" not in out
    assert "grpo" not in out and "validation" not in out and "accuracy_by_template" not in out
    after_time = len(vars(val))  # the validation keys
    assert list(out)[-after_time - 1] == "time" and list(out)[:2] == ["step", "attempt"]  # after GRPO's, before val
    assert {"step", "attempt", "loss", "val_loss", "reward", "plane_bytes"} <= set(NUMBER_KEYS)
    assert "sample_ids" not in NUMBER_KEYS and "accuracy_by_template" not in NUMBER_KEYS
