"""GrpoWorker: the Ray actor of one GRPO rank (a `RankWorker`: policy, generation engine, validation,
checkpoints). The generation engine is colocated in the same process and refit from the policy in
memory each step; the replica's owner rank holds the loader shard; every rank a data-plane client.

Stages, each one call from the controller (stages.py):

1. `rollout`: refit, take the replica's prompts (its own loader shard, or given by the driver), sample
   G responses each, score them, and write the rollout once to the replica's partition (or return
   it, on the driver path).
2. `logprob`: fetch the logprob stage's fields of the replica's samples, run the policy (and the
   reference) forward per micro-batch; on the plane paths it then waits until the controller says
   the step's advantages are in the partition (`advantages_written`, a side call: stages.py, 1), and
   leaves the write of prev (and ref) logprobs, and the train stage's read, queued on its plane.
3. `train`: fetch the train fields, take `grpo.inner_steps` optimizer steps with the clipped PG loss,
   clear the partition.

Every stage builds its micro-batches with the same function from the same samples in the same order
(micro_batches.py), whichever way the samples came, so the plane paths and the driver path give the
same numbers. A replica of several ranks (tensor or pipeline parallel) reads and writes the plane on its
owner rank alone, which holds the engine too: its other ranks take part in the refit (collective), get
each stage's samples from the owner (`RankWorker.from_owner`) and run the stage's forwards and steps. `plane_get` / `plane_put` let the controller reach a process-local (`local`) plane; they
and `advantages_written` run beside the stage in progress (worker_group.side_call).
"""

from __future__ import annotations

import time

from vlmrun.algorithms.common.refit import refit
from vlmrun.algorithms.common.worker import RankWorker
from vlmrun.algorithms.grpo.fields import GrpoStage
from vlmrun.algorithms.grpo.loss import ClippedPgLoss
from vlmrun.algorithms.grpo.micro_batches import (
    batch_response_values,
    model_batches,
    pg_micro_batches,
    sequence_lengths,
    token_groups,
)
from vlmrun.algorithms.grpo.partition import (
    StageGets,
    StagePlane,
    partition_name,
    rollout_spec,
    split_fields,
    stage_fields,
)
from vlmrun.algorithms.grpo.reports import LogprobReport, RolloutReport, TrainReport, kept
from vlmrun.algorithms.grpo.rollout_rows import (
    RolloutRows,
    ended_with,
    join,
    prompt_columns,
    response_columns,
    response_lengths,
    response_sample_ids,
)
from vlmrun.checkpoint.parts import MODEL_PART, OPTIMIZER_PART
from vlmrun.checkpoint.read import Checkpoint
from vlmrun.checkpoint.write import PendingCheckpoint
from vlmrun.config.dtype import torch_dtype
from vlmrun.data.epochs import is_filler
from vlmrun.data.packing import rows_in_order
from vlmrun.distributed.worker_group import StepGate, side_call
from vlmrun.generation.interface import SamplingParams
from vlmrun.generation.prompts import join_prompts
from vlmrun.plane.interface import Put, SampleBatch
from vlmrun.rewards.terms import reward_terms, score_responses


class GrpoWorker(RankWorker):
    needs_generator = True

    def __init__(self, *, plane_endpoint=None, plane_enabled: bool = True, **kwargs):
        super().__init__(**kwargs)
        r = self.recipe
        self.dtype = torch_dtype(r.model.dtype)
        self.sampling = SamplingParams(
            temperature=r.grpo.temperature,
            top_p=r.grpo.top_p,
            max_new_tokens=r.grpo.max_new_tokens,
            seed=r.train.seed,
        )
        self.loss = ClippedPgLoss(r.grpo)
        self.reward_terms = reward_terms(r.grpo)  # imported and checked again here, on the rank's node
        self.rows_per_micro = r.train.micro_batch_size * r.grpo.num_generations
        self.on_plane = plane_enabled
        reads = plane_enabled and self.owner  # one plane reader per replica: its owner
        self.plane = StagePlane.open(plane_endpoint, pixel_dtype=self.dtype) if reads else None
        self._advantages = StepGate()

    # ---- stages ----------------------------------------------------------------------------------
    def rollout(self, step: int, n_micro: int = 0, prompts: list | None = None) -> RolloutReport:
        """Stage 1. The driver path passes `prompts` (the replica's prompt micro-batches) and gets the
        rollout back in the report's `rows`; the plane paths take `n_micro` micro-batches from the owned loader.
        A rank that does not own its replica takes part in the refit and reports nothing (None)."""
        if not self.owner:
            refit(None, self.policy, bucket_bytes=self.refit_bytes)
            return None
        t0 = time.perf_counter()
        if prompts is None:
            prompts = [self.loader.next_batch() for _ in range(n_micro)]
        times = {"loader": time.perf_counter() - t0}
        batch = join_prompts(prompts, self.pad_token_id)
        prompt_rows = prompt_columns(batch, family=self.recipe.family, image_token_id=self.image_token_id)
        part = partition_name(step, self.replica)
        g = self.recipe.grpo.num_generations
        if self.plane is not None:  # the prompt samples go (and the next stage's read of them) while it generates
            self.plane.register(part, rollout_spec(self.recipe, len(prompt_rows) * (1 + g)), wait=False)
            self.plane.put_many([Put(part, prompt_rows.sample_ids, prompt_rows.columns)], wait=False)
            response_ids = response_sample_ids(prompt_rows.sample_ids, g)
            self.plane.prefetch([self._gets(part, response_ids, GrpoStage.LOGPROB).prompts])  # partition.py, 3
        offload = self.recipe.parallel.offload_during_generation
        t0 = time.perf_counter()
        if offload:  # the engine's weights and KV cache take the optimizer's memory, then the weights'
            self.policy.offload_to_host((OPTIMIZER_PART,))
        refit(self.generator, self.policy, bucket_bytes=self.refit_bytes)
        if offload:
            self.policy.offload_to_host((MODEL_PART,))
        times["refit"] = time.perf_counter() - t0
        rollouts = self.generator.generate(batch, self.sampling, n=g)
        times["generation"] = rollouts.generate_s
        if self.recipe.generation.sleeps_between_uses:  # the training stages run without the engine's copy
            self.generator.release_weights()
        if offload:
            t0 = time.perf_counter()
            self.policy.restore_from_host()
            times["refit"] += time.perf_counter() - t0
        t0 = time.perf_counter()
        scored = self._rewards(rollouts)
        responses = response_columns(rollouts, scored, prompt_rows.sample_ids)
        times["reward"] = time.perf_counter() - t0
        real = [not is_filler(i) for i in responses.sample_ids]  # fillers (data/epochs.py) count in no metric
        real_prompts = [not is_filler(i) for i in batch.sample_ids]
        report = RolloutReport(
            prompts=kept(batch.sample_ids, real_prompts),
            templates=kept(list(batch.templates) or [""] * len(batch), real_prompts),
            sample_ids=responses.sample_ids,
            rewards=kept([s.reward for s in scored], real),
            correct=kept([s.correct for s in scored], real),
            well_formed=kept([s.well_formed for s in scored], real),
            reward_parts=kept([s.parts for s in scored], real),
            lengths=kept(response_lengths(rollouts), real),
            generated_tokens=rollouts.response_ids.numel(),
            times=times,
            loader_counts=self.loader.counts() if self.loader is not None else None,
        )
        if self.plane is None:
            report.rows = RolloutRows(prompts=prompt_rows, responses=responses)
            return report
        self.plane.put_many([Put(part, responses.sample_ids, responses.columns)])
        self.plane.prefetch([self._gets(part, responses.sample_ids, GrpoStage.LOGPROB).rollout])
        report.plane = self.plane.take()
        return report

    def _rewards(self, rollouts) -> list:
        """Every response's reward (vlmrun/rewards), from its text and whether it ended its turn."""
        g = self.recipe.grpo
        ended = ended_with(rollouts, self.generator.eos_ids)
        samples = [{"answer": a, "sample_id": s} for a, s in zip(rollouts.answers, rollouts.sample_ids, strict=True)]
        texts = self._decode(rollouts)
        return score_responses(self.reward_terms, texts, samples, ended, format_reward=g.format_reward)

    def logprob(self, step: int, sample_ids: list[str], rows: RolloutRows | None = None) -> LogprobReport:
        """Stage 2: prev (and, with KL, ref) logprobs of the replica's samples."""
        got = self._fetch(step, sample_ids, GrpoStage.LOGPROB, rows)
        part = partition_name(step, self.replica)
        train = self._gets(part, sample_ids, GrpoStage.TRAIN) if self.plane is not None else None
        if self.plane is not None:  # what the train stage reads of the rollout comes while this computes
            self.plane.prefetch([train.rollout, train.prompts])
        t0 = time.perf_counter()
        kl = self.recipe.grpo.kl_coef > 0
        out: dict[str, list] = {"prev_logprobs": [], **({"ref_logprobs": []} if kl else {})}
        start = 0
        for b in self._model_batches(got):
            out["prev_logprobs"] += batch_response_values(self.policy.logprobs(b), b, got, start)
            if kl:
                out["ref_logprobs"] += batch_response_values(self.policy.reference_logprobs(b), b, got, start)
            start += len(b)
        report = LogprobReport(times={GrpoStage.LOGPROB: time.perf_counter() - t0})
        if not self.on_plane:
            report.columns = out
            return report
        if self.plane is None:  # the replica's owner writes them (the same values: every rank computed them)
            report.plane = {"seconds": 0.0, "bytes": 0}
            return report
        # A sample's writes must not overlap: the controller's advantages first (stages.py, 1). Then the
        # write, and the train stage's read of its response fields, go on the plane thread in order.
        self._advantages.wait(step)
        self.plane.put_many([Put(part, list(sample_ids), out)], wait=False)
        if train.later is not None:
            self.plane.prefetch([train.later])
        report.plane = self.plane.take()
        return report

    @side_call
    def advantages_written(self, step: int, ok: bool = True) -> None:
        """The controller's word that step `step`'s advantages are in the partition (`ok`), or that its
        advantage stage failed: a `logprob` waiting for them goes on, or raises."""
        self._advantages.open(step, ok)

    def train(self, step: int, sample_ids: list[str], rows: RolloutRows | None = None) -> TrainReport:
        """Stage 3: `grpo.inner_steps` optimizer steps over the replica's samples; the partition is cleared
        (while the steps run: the plane is empty when the stage returns)."""
        try:
            got = self._fetch(step, sample_ids, GrpoStage.TRAIN, rows)
        finally:  # the owner's plane
            if self.plane is not None:
                self.plane.clear(partition_name(step, self.replica), wait=False)
        t0 = time.perf_counter()
        batches = pg_micro_batches(got, self.rows_per_micro, **self._layout(got))
        k = self.recipe.grpo.inner_steps
        per = len(batches) // k
        results = [self.policy.train_step(batches[j * per : (j + 1) * per], self.loss) for j in range(k)]
        times = {GrpoStage.TRAIN: time.perf_counter() - t0}
        if self.plane is not None:
            self.plane.flush()
        moved = self.plane.take() if self.plane is not None else {"seconds": 0.0, "bytes": 0}
        return TrainReport(results, times, moved if self.on_plane else {})

    def _fetch(self, step: int, sample_ids: list[str], stage: GrpoStage, rows: RolloutRows | None) -> SampleBatch:
        """The stage's fields of the responses `sample_ids`, each with its prompt's: from the plane (read by
        the replica's owner, handed to its other ranks), or from `rows` as the driver sent them (exactly
        the stage's fields)."""
        if self.on_plane:
            got = None
            if self.plane is not None:
                gets = self._gets(partition_name(step, self.replica), sample_ids, stage).all()
                got = StageGets.joined(self.plane.get_many(gets))
            return self.from_owner(got)
        prompt_fields, response_fields = split_fields(stage_fields(self.recipe, stage))
        sent = set(rows.prompts.columns) | set(rows.responses.columns)
        if rows.responses.sample_ids != list(sample_ids) or sent != {*prompt_fields, *response_fields}:
            raise ValueError(f"the driver sent the {stage} stage other samples or fields than it reads")
        return join(rows.prompts, rows.responses)

    def _gets(self, part: str, sample_ids: list[str], stage: GrpoStage) -> StageGets:
        """`stage`'s requests: its fields of the responses `sample_ids`, and of their prompt samples."""
        return StageGets.of(self.recipe, part, sample_ids, stage)

    def _model_batches(self, got: SampleBatch) -> list:
        return model_batches(got, self.rows_per_micro, **self._layout(got))

    def _layout(self, got: SampleBatch) -> dict:
        """How a stage lays `got` out (both stages the same way: the ratio stays 1); with data.pack_by:
        tokens, as rows of data.pack_tokens, as many on every rank as the rank that fills the most."""
        d = self.recipe.data
        layout = {
            "family": self.recipe.family,
            "pad_token_id": self.pad_token_id,
            "pixel_dtype": self.dtype,
            "pack_tokens": d.pack_tokens,
        }
        if d.pack_by == "tokens":
            count = self.most_over_ranks(len(rows_in_order(sequence_lengths(got), d.pack_tokens)))
            layout["groups"] = token_groups(got, d.pack_tokens, count)
        return layout

    # ---- the controller's reach into a process-local plane ----------------------------------------
    @side_call
    def plane_get(self, partition: str, sample_ids: list[str], fields: list[str]) -> SampleBatch:
        return self.plane.serve("get", partition, sample_ids, fields)

    @side_call
    def plane_put(self, partition: str, sample_ids: list[str], columns: dict) -> None:
        self.plane.serve("put", partition, sample_ids, columns)

    # ---- checkpoints ------------------------------------------------------------------------------
    def _save_own(self, pending: PendingCheckpoint) -> dict[str, dict]:
        """The sampling stream, on the replica's owner rank (every rank of a replica holds the same)."""
        return pending.write("generation", self.generator.state_dict(), index=self.replica) if self.owner else {}

    def _load_own(self, checkpoint: Checkpoint) -> None:
        if self.generator is not None:  # the replica's owner
            self.generator.load_state_dict(checkpoint.read("generation", index=self.replica))

    def shutdown(self) -> None:
        try:
            if self.plane is not None:
                self.plane.close()
        finally:
            super().shutdown()
