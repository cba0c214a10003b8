"""Validation: every algorithm's held-out score, computed on the ranks with the policy and a generation engine.

1. The val batches are cut into one `ValidationShare` per data-parallel replica (`validation_shares`):
   replica r scores loss batches r, r + n, ... and answers prompt batches r, r + n, ... In a run, rank 0
   reads and cuts them and keeps the shares in Ray's object store; the controller holds a
   `ValidationSet` of references and hands every rank its replica's. Every rank of a replica runs the
   share's forwards (a tensor- or pipeline-parallel policy's are collective over the replica's ranks,
   and give each of them the logprobs); its owner rank answers the prompts, and the controller takes
   the owner's score (`WorkerGroup.collect`). With one rank per replica, a rank is its replica.
2. On each rank, `evaluate` takes the NLL of the loss batches from the policy's `logprobs` and the
   greedy answers from a generation engine refit from the policy (refit.py: streamed), so the policy
   seam holds no validation code and a sharded policy never gathers the whole model for a forward.
3. Collectives: a sharded (FSDP2) forward gathers parameters from every rank, so every rank makes the
   same number of `logprobs` calls: a share with fewer loss batches is padded with repeats of a batch
   whose result is discarded. The refit is collective too: every rank refits, also one with no prompt.
   Generation itself runs on the engine's own copy of the weights, with no collective; an engine that
   generates with the sharded policy's own model (a GPU SFT run: worker.py) gathers collectively, so
   its share's prompt batches are padded the same way (`prompt_padding`, answered and discarded).
4. The shares' `ValidationScore`s sum to one pass; `validation_row` makes the metrics row's keys of it.
   A pass that scored no token (every label cut away) has no loss: `val_loss` is null, `val_tokens` 0.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

from vlmrun.algorithms.common.refit import refit
from vlmrun.generation.interface import GenerationBackend, SamplingParams
from vlmrun.policy.interface import REFIT_BUCKET_BYTES, PolicyBackend
from vlmrun.run.rows import Validation

log = logging.getLogger(__name__)

#: Validation's answers: greedy (temperature 0 draws nothing from a sampling stream), a few tokens.
GREEDY = SamplingParams(temperature=0.0, max_new_tokens=4)


@dataclass(frozen=True)
class ValidationShare:
    """One rank's part of a pass: `loss_batches` are scored, `padding` run and discarded (module doc),
    `prompt_batches` answered (`prompt_padding` answered and discarded by a collective engine)."""

    loss_batches: list
    prompt_batches: list
    padding: list = field(default_factory=list)
    prompt_padding: list = field(default_factory=list)


@dataclass(frozen=True)
class ValidationSet:
    """A run's val set as the controller holds it: every rank's share (in rank order; a reference to it in
    Ray's object store), every prompt's reference answer, the val samples the loader left out, and how
    many were asked for (the split may run out first)."""

    shares: list
    answers: list[str]
    dropped: int = 0
    requested: int = 0

    def row(self, score: ValidationScore) -> Validation:
        """The metrics row's validation keys of a pass over this set that scored `score`."""
        return validation_row(score, self.answers, dropped=self.dropped, requested=self.requested)


@dataclass(frozen=True)
class ValidationScore:
    """Sums over a share (or, added up, over a pass): NLL over `tokens` label tokens, `correct` of
    `answered` greedy answers exactly right."""

    nll: float = 0.0
    tokens: int = 0
    correct: int = 0
    answered: int = 0

    def __add__(self, other: ValidationScore) -> ValidationScore:
        return ValidationScore(
            self.nll + other.nll,
            self.tokens + other.tokens,
            self.correct + other.correct,
            self.answered + other.answered,
        )


def validation_shares(loss_batches: list, prompt_batches: list, ranks: int) -> list[ValidationShare]:
    """Every rank's share, each with as many forward calls as the largest (module doc)."""
    scored = [loss_batches[r::ranks] for r in range(ranks)]
    answered = [prompt_batches[r::ranks] for r in range(ranks)]
    return [
        ValidationShare(mine, asked, _padding(mine, loss_batches, scored), _padding(asked, prompt_batches, answered))
        for mine, asked in zip(scored, answered, strict=True)
    ]


def _padding(mine: list, every: list, shares: list[list]) -> list:
    """Repeats of a batch that bring `mine` to the longest share's length (none when there is no batch)."""
    filler = mine[-1] if mine else (every[0] if every else None)
    return [filler] * (max(len(s) for s in shares) - len(mine)) if filler is not None else []


def evaluate(
    share: ValidationShare,
    *,
    policy: PolicyBackend,
    generator: GenerationBackend | None,
    decode: Callable[[object], list[str]],
    refit_bytes: int = REFIT_BUCKET_BYTES,
    on_answers: Callable[[list[str], object, object], None] | None = None,
) -> ValidationScore:
    """This rank's score of `share`: the NLL from `policy.logprobs`, greedy answers from `generator` once
    it is refit from `policy` (`refit_bytes` a bucket); `decode(rollouts)` gives the responses' texts.
    Every rank calls it together; a rank without `generator` (not its replica's owner) takes part in
    the refit and answers nothing. `on_answers(texts, prompts, rollouts)`, when given, sees every prompt
    batch's answers (`vlmrun eval` scores them by template and reward)."""
    from vlmrun.policy.loss import valid_tokens  # torch: imported by the ranks, never the controller

    nll, tokens = 0.0, 0
    for batch in share.loss_batches:
        nll += -float(policy.logprobs(batch).sum())
        tokens += valid_tokens(batch.labels)
    for batch in share.padding:  # the same number of (collective) forwards on every rank
        policy.logprobs(batch)
    refit(generator, policy, bucket_bytes=refit_bytes)
    correct = answered = 0
    for prompts in share.prompt_batches if generator is not None else ():
        rollouts = generator.generate(prompts, GREEDY, n=1)
        texts = decode(rollouts)
        if on_answers is not None:
            on_answers(texts, prompts, rollouts)
        for text, answer in zip(texts, prompts.answers, strict=True):
            correct += text.strip() == answer.strip()
            answered += 1
    for prompts in share.prompt_padding if getattr(generator, "reads_policy_weights", False) else ():
        generator.generate(prompts, GREEDY, n=1)  # as many collective calls as every other rank
    return ValidationScore(nll, tokens, correct, answered)


def response_texts(tokenizer, rollouts) -> list[str]:
    """The texts of the rollouts' responses (padding and special tokens dropped)."""
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    return tokenizer.batch_decode(
        rollouts.response_ids.masked_fill(rollouts.response_mask == 0, pad), skip_special_tokens=True
    )


def validation_row(score: ValidationScore, answers: list[str], *, dropped: int = 0, requested: int = 0) -> Validation:
    """The metrics row's validation keys of a whole pass; `answers` are every prompt's reference answer,
    `dropped` the val samples the loader left out, `requested` how many were asked for."""
    return Validation(
        val_loss=score.nll / score.tokens if score.tokens else None,
        val_accuracy=score.correct / score.answered if score.answered else None,
        val_samples=score.answered,
        val_tokens=score.tokens,
        val_majority_baseline=majority_share(answers),
        val_dropped_samples=dropped,
        val_samples_requested=requested,
    )


def majority_share(answers: list[str]) -> float:
    """Accuracy of always answering the most common answer: the bar a model must beat."""
    return Counter(answers).most_common(1)[0][1] / len(answers) if answers else 0.0


class ValidationPasses:
    """The controller's side of validation (module doc): the val set read, encoded and cut once by rank 0,
    which has the loader's stack imported (the shares' tensors never reach the controller, which holds
    no torch); each pass hands every rank its replica's share and sums the owners' scores."""

    def __init__(self, group, plan, recipe) -> None:
        self.group, self.plan, self.recipe = group, plan, recipe
        self._val: ValidationSet | None = None

    def run(self, step: int) -> Validation:
        r = self.recipe
        if self._val is None:
            size = max(1, r.train.micro_batch_size)
            self._val = self.group.on_rank(
                0, "val_set", samples=r.train.val_samples, batch_size=size, ranks=self.plan.layout.dp
            )
        val = self._val
        scores = self.group.per_rank("validate", lambda rank: {"share": val.shares[self.plan.shard_of_rank(rank)]})
        owned = [scores[s.owner_rank] for s in self.plan.shards]  # each replica's, from its owner
        validation = val.row(sum(owned, ValidationScore()))
        if validation.val_loss is None:
            log.warning(
                "validation at step %d scored no token of %d val samples (every label cut away? data.max_seq_len "
                "is %d): val_loss is null, val_tokens 0",
                step,
                r.train.val_samples,
                r.data.max_seq_len,
            )
        return validation
