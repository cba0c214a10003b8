"""Validation at the algorithm level (algorithms/common/validation.py): the NLL from the policy's logprobs,
greedy answers from a generation engine refit from the policy, a typed score; every rank makes the same
collective calls (2 FSDP2 ranks on gloo); a pass that scored no token says so instead of a 0.0 loss."""

from __future__ import annotations

import dataclasses
import json
import os
from collections import Counter
from pathlib import Path

import pytest
import torch

from vlmrun.algorithms.common.validation import (
    ValidationScore,
    ValidationShare,
    evaluate,
    validation_row,
    validation_shares,
)
from vlmrun.data.batch import IGNORE_INDEX, Batch, PromptBatch
from vlmrun.generation.rollouts import Rollouts


def _batch(name: str, labelled: int = 3) -> Batch:
    ids = torch.arange(1, 7)[None]
    labels = ids.clone()
    labels[:, : ids.shape[1] - labelled] = IGNORE_INDEX
    return Batch([name], ids, torch.ones_like(ids), labels)


def _prompts(answers: list[str]) -> PromptBatch:
    ids = torch.ones(len(answers), 3, dtype=torch.long)
    return PromptBatch([f"p{i}" for i in range(len(answers))], ids, torch.ones_like(ids), answers)


class FakePolicy:
    """log p = -0.5 per labelled token; counts the calls a sharded policy would make collectively."""

    def __init__(self):
        self.forwards, self.refits = [], 0

    def logprobs(self, batch):
        self.forwards.append(batch.sample_ids[0])
        return torch.where(batch.labels[:, 1:] == IGNORE_INDEX, 0.0, -0.5)

    def weights_for_refit(self, *, dtype=None, bucket_bytes=0):
        self.refits += 1
        yield {"w": torch.ones(1)}


class FakeGenerator:
    """Answers "3" to every prompt once refit; remembers how it was asked."""

    weights_dtype = "float32"

    def __init__(self):
        self.weights, self.calls = None, []

    def refit_targets(self):
        return None  # takes the buckets it is given

    def load_weights(self, weights):
        self.weights = [dict(bucket) for bucket in weights]

    def generate(self, prompts, sampling, *, n):
        assert self.weights is not None, "generated before the refit"
        self.calls.append((sampling.temperature, n))
        ids = torch.ones(len(prompts), 1, dtype=torch.long)
        return Rollouts(1, prompts.sample_ids, prompts.answers, ids, ids, ids, ids, ids.float(), 0)


def test_shares_give_every_rank_the_same_number_of_forward_calls():
    loss = [_batch(f"b{i}") for i in range(3)]
    shares = validation_shares(loss, [_prompts(["1"])], ranks=4)
    assert [[b.sample_ids[0] for b in s.loss_batches] for s in shares] == [["b0"], ["b1"], ["b2"], []]
    assert [len(s.loss_batches) + len(s.padding) for s in shares] == [1, 1, 1, 1]
    assert shares[3].padding[0] is loss[0]  # a rank without batches repeats one of another's
    assert [len(s.prompt_batches) for s in shares] == [1, 0, 0, 0]
    two = validation_shares(loss, [], ranks=2)
    assert [len(s.padding) for s in two] == [0, 1] and two[1].padding[0] is two[1].loss_batches[-1]


def test_the_nll_counts_the_scored_batches_and_answers_come_greedy_after_a_refit():
    policy, engine = FakePolicy(), FakeGenerator()
    share = ValidationShare([_batch("a", 3), _batch("b", 2)], [_prompts(["3", " 3 ", "4"])], padding=[_batch("a", 3)])
    score = evaluate(share, policy=policy, generator=engine, decode=lambda r: ["3"] * len(r))
    assert score == ValidationScore(nll=0.5 * 5, tokens=5, correct=2, answered=3)  # the padding is not counted
    assert policy.forwards == ["a", "b", "a"] and policy.refits == 1 and engine.calls == [(0.0, 1)]
    row = validation_row(score + ValidationScore(1.5, 1, 1, 1), ["3", "3", "4", "4", "4"])
    assert row.val_loss == 4.0 / 6 and row.val_accuracy == 3 / 4 and row.val_samples == 4 and row.val_tokens == 6
    assert row.val_majority_baseline == 3 / 5


def test_a_pass_that_scored_no_token_has_no_loss_and_says_so():
    from vlmrun.observe.progress import ProgressLine

    policy, engine = FakePolicy(), FakeGenerator()
    share = ValidationShare([_batch("cut", labelled=0)], [_prompts(["3"])])
    score = evaluate(share, policy=policy, generator=engine, decode=lambda r: ["4"])
    row = validation_row(score, ["3"])
    assert score.tokens == 0 and row.val_loss is None and row.val_tokens == 0 and row.val_accuracy == 0.0
    line = ProgressLine(10)({"step": 1, "loss": 1.0, "grad_norm": 0.1, **dataclasses.asdict(row)})
    assert "val_loss none (no token scored)" in line


def test_a_pass_the_val_split_ran_short_for_says_how_many_of_those_asked_for_it_scored():
    """7 val samples asked for, 2 of them dropped: the row and the console say 5 of 7 were scored."""
    from vlmrun.algorithms.common.validation import ValidationSet
    from vlmrun.observe.progress import ProgressLine, val_scored

    answers = ["3", "4", "3", "5", "3"]
    row = ValidationSet([], answers, dropped=2, requested=7).row(ValidationScore(5.0, 10, 3, 5))
    assert (row.val_samples, row.val_samples_requested, row.val_dropped_samples) == (5, 7, 2)
    shown = {"step": 1, "loss": 1.0, "grad_norm": 0.1, **dataclasses.asdict(row)}
    assert ProgressLine(10)(shown).endswith(" on 5 of 7 val samples asked for (2 dropped)")
    whole = validation_row(ValidationScore(5.0, 10, 3, 5), answers, requested=5)
    assert val_scored(dataclasses.asdict(whole)) == "5 val samples"
    assert " on " not in ProgressLine(10)({**shown, **dataclasses.asdict(whole)})


class CountedPolicy:
    """A policy whose collective calls (forwards and refits, under FSDP2) are counted."""

    def __init__(self, policy):
        self.policy, self.calls = policy, Counter()

    def logprobs(self, batch):
        self.calls["forward"] += 1
        return self.policy.logprobs(batch)

    def weights_for_refit(self, **kwargs):
        self.calls["refit"] += 1
        return self.policy.weights_for_refit(**kwargs)


def _answers(model_dir: str):
    """A setup engine of `model_dir` and the decode of its responses."""
    from transformers import AutoTokenizer

    from vlmrun.generation import open_generator
    from vlmrun.models.spec import ModelSpec

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    engine = open_generator("hf", model=ModelSpec(directory=model_dir))
    engine.setup()
    return engine, lambda rollouts: tokenizer.batch_decode(rollouts.response_ids, skip_special_tokens=True)


def _rank_main(rank, world, recipe, model_dir, shares, port, out):
    """One FSDP2 rank: evaluate its share, counting its collective calls; then a random-init sharded
    policy (meta device, materialized shard by shard) trains a step. Writes its results to `out`."""
    from vlmrun.models.spec import ModelSpec
    from vlmrun.policy import open_policy

    torch.set_num_threads(1)
    parallel = recipe.parallel.model_copy(update={"dp": world, "fsdp": True})

    def sharded(model: ModelSpec, port: int):
        p = open_policy("hf", model=model, rank=rank, world_size=world, train=recipe.train, parallel=parallel)
        p.setup(master_addr="127.0.0.1", master_port=port, max_steps=4)
        return p

    policy = CountedPolicy(sharded(ModelSpec(directory=model_dir), port))
    engine, decode = _answers(model_dir)
    score = evaluate(shares[rank], policy=policy, generator=engine, decode=decode)
    policy.policy.shutdown()
    config = json.loads((Path(model_dir) / "config.json").read_text())
    random_init = sharded(ModelSpec(config=config, seed=3), port + 1)
    step = random_init.train_step(shares[0].loss_batches[:1])
    torch.save({"score": score, "calls": dict(policy.calls), "step": (step.loss, step.grad_norm)}, f"{out}.{rank}")
    random_init.shutdown()
    os._exit(0)  # skip interpreter teardown: gloo's threads sometimes abort in C++ destructors at exit


@pytest.mark.slow  # two spawned FSDP2 ranks
def test_fsdp_ranks_make_the_same_collective_calls_and_score_what_one_replica_scores(clevr_set, tiny_dirs, tmp_path):
    from data_samples import free_port, make_recipe, start_ranks

    from vlmrun.data.loader import val_batches
    from vlmrun.models.spec import ModelSpec
    from vlmrun.policy import open_policy

    model_dir = tiny_dirs["qwen2_5_vl"]
    recipe = make_recipe(clevr_set)
    loss_b, prompt_b, _ = val_batches(recipe, processor_dir=model_dir, samples=6, batch_size=2)
    shares = validation_shares(loss_b, prompt_b[:1], ranks=2)  # rank 0: 2 batches and the prompts, rank 1: 1 + 1
    assert len(shares[1].padding) == 1 and not shares[1].prompt_batches
    port = free_port()
    start_ranks(_rank_main, (2, recipe, model_dir, shares, port, str(tmp_path / "r")))
    got = [torch.load(tmp_path / f"r.{rank}", weights_only=False) for rank in range(2)]
    assert got[0]["calls"] == got[1]["calls"] == {"forward": 2, "refit": 1}
    assert got[0]["step"] == got[1]["step"] and torch.isfinite(torch.tensor(got[0]["step"])).all()

    one = open_policy("hf", model=ModelSpec(directory=model_dir), rank=0, world_size=1, train=recipe.train)
    one.setup(master_addr="127.0.0.1", master_port=0, max_steps=4)
    engine, decode = _answers(model_dir)
    for rank in range(2):
        want = evaluate(shares[rank], policy=one, generator=engine, decode=decode)
        assert got[rank]["score"] == want, rank
    one.shutdown()


def _policy_answers_rank(rank, world, recipe, model_dir, shares, port, out):
    """One FSDP2 rank that answers with the policy's own model (no engine copy): its score, its generate
    calls, and whether the engine held a model of its own."""
    from transformers import AutoTokenizer

    from vlmrun.generation import open_generator
    from vlmrun.models.spec import ModelSpec
    from vlmrun.policy import open_policy

    torch.set_num_threads(1)
    parallel = recipe.parallel.model_copy(update={"dp": world, "fsdp": True})
    policy = open_policy(
        "hf", model=ModelSpec(directory=model_dir), rank=rank, world_size=world, train=recipe.train, parallel=parallel
    )
    policy.setup(master_addr="127.0.0.1", master_port=port, max_steps=4)
    engine = open_generator(
        "hf", model=ModelSpec(directory=model_dir), weights="policy", policy_model=policy.generation_model()
    )
    engine.setup()
    calls = []
    generate = engine.generate
    engine.generate = lambda prompts, sampling, *, n: calls.append(len(prompts)) or generate(prompts, sampling, n=n)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    decode = lambda rollouts: tokenizer.batch_decode(rollouts.response_ids, skip_special_tokens=True)  # noqa: E731
    score = evaluate(shares[rank], policy=policy, generator=engine, decode=decode)
    own = engine.model is policy.model and engine.reads_policy_weights
    torch.save({"score": score, "calls": calls, "own_model": not own}, f"{out}.{rank}")
    policy.shutdown()
    os._exit(0)


@pytest.mark.slow  # two spawned FSDP2 ranks
def test_fsdp_ranks_answer_with_the_policy_s_own_model_as_an_engine_copy_would(clevr_set, tiny_dirs, tmp_path):
    """A GPU SFT run's validation (Recipe.validates_with_the_policy): no rank builds a copy of the weights;
    the ranks answer with the sharded policy itself, each as many (collective) generate calls as the
    others, and score what a whole model and its engine score."""
    from data_samples import free_port, make_recipe, start_ranks

    from vlmrun.data.loader import val_batches
    from vlmrun.models.spec import ModelSpec
    from vlmrun.policy import open_policy

    model_dir = tiny_dirs["qwen2_5_vl"]
    recipe = make_recipe(clevr_set)
    loss_b, prompt_b, _ = val_batches(recipe, processor_dir=model_dir, samples=6, batch_size=2)
    shares = validation_shares(loss_b[:2], prompt_b, ranks=2)  # rank 0: 2 prompt batches, rank 1: 1 + 1 padding
    assert [len(s.prompt_batches) for s in shares] == [2, 1] and len(shares[1].prompt_padding) == 1
    start_ranks(_policy_answers_rank, (2, recipe, model_dir, shares, free_port(), str(tmp_path / "r")))
    got = [torch.load(tmp_path / f"r.{rank}", weights_only=False) for rank in range(2)]
    assert [len(g["calls"]) for g in got] == [2, 2] and not any(g["own_model"] for g in got)

    one = open_policy("hf", model=ModelSpec(directory=model_dir), rank=0, world_size=1, train=recipe.train)
    one.setup(master_addr="127.0.0.1", master_port=0, max_steps=4)
    engine, decode = _answers(model_dir)
    for rank in range(2):
        assert got[rank]["score"] == evaluate(shares[rank], policy=one, generator=engine, decode=decode), rank
    one.shutdown()
