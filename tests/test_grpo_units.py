"""GRPO's pieces with hand-made inputs (the rewards' own: tests/test_rewards.py): group-normalized advantages, the clipped PG loss, the
sample ids and columns of a rollout, the micro-batches built from them, and the recipe's refusals."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from vlmrun.algorithms.grpo.advantages import group_advantages
from vlmrun.algorithms.grpo.fields import GrpoStage
from vlmrun.algorithms.grpo.loss import ClippedPgLoss, k3
from vlmrun.algorithms.grpo.micro_batches import (
    PgMicroBatch,
    batch_response_values,
    model_batches,
    pg_micro_batches,
    place_response_values,
    response_values,
    sequence_starts,
)
from vlmrun.algorithms.grpo.partition import (
    StageGets,
    StagePlane,
    partition_name,
    rollout_spec,
    split_fields,
    stage_fields,
    value_bytes,
)
from vlmrun.algorithms.grpo.rollout_rows import (
    ended_with,
    join,
    prompt_columns,
    prompt_of,
    prompt_sample_ids,
    response_sample_ids,
    rollout_columns,
)
from vlmrun.config.grpo import GrpoConfig
from vlmrun.config.load import load_recipe
from vlmrun.data.batch import IGNORE_INDEX, Batch, PromptBatch
from vlmrun.data.epochs import filler_id
from vlmrun.errors import InputError
from vlmrun.generation.rollouts import Rollouts
from vlmrun.plane.interface import DataPlaneError, Get, PartitionSpec, Put, SampleBatch
from vlmrun.plane.local import LocalDataPlane
from vlmrun.policy.loss import token_logprobs
from vlmrun.rewards.builtin import clevr_exact
from vlmrun.rewards.terms import reward_terms, score_responses

ROOT = Path(__file__).resolve().parents[1]
GRPO = ROOT / "recipes" / "tiny-grpo-cpu.yaml"


# ---- advantages ----------------------------------------------------------------------------------
def test_advantages_are_normalized_within_each_group():
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 0.5, 0.5, 0.5, 0.5])
    adv = group_advantages(rewards, 4)
    assert torch.allclose(adv[:4], torch.tensor([1.0, -1.0, -1.0, 1.0]), atol=1e-5)
    assert torch.equal(adv[4:], torch.zeros(4))  # no spread, no signal
    centered = group_advantages(rewards, 4, normalize_std=False)
    assert torch.allclose(centered[:4], torch.tensor([0.5, -0.5, -0.5, 0.5]))
    with pytest.raises(ValueError, match="groups of 3"):
        group_advantages(rewards, 3)


# ---- the loss ------------------------------------------------------------------------------------
def fake_micro_batch(logits: torch.Tensor, advantages: list[float], prev_shift: float = 0.0) -> PgMicroBatch:
    """Two rows of 5 tokens: a 2-token prompt and a 3-token response; prev = current logprobs + shift."""
    ids = torch.tensor([[1, 2, 3, 4, 5], [1, 2, 5, 4, 3]])
    labels = ids.clone()
    labels[:, :2] = IGNORE_INDEX
    batch = Batch(sample_ids=["a", "b"], input_ids=ids, attention_mask=torch.ones_like(ids), labels=labels)
    current = token_logprobs(logits, labels)
    mask = labels[:, 1:] != IGNORE_INDEX
    return PgMicroBatch(
        batch=batch,
        advantages=torch.tensor(advantages)[:, None].expand(mask.shape).masked_fill(~mask, 0.0),
        prev_logprobs=(current + prev_shift).masked_fill(~mask, 0.0),
        generation_logprobs=current.clone(),
        ref_logprobs=current.clone(),
    )


def test_one_inner_step_gives_ratio_one_and_minus_the_mean_advantage():
    logits = torch.randn(2, 5, 8, generator=torch.Generator().manual_seed(0), requires_grad=True)
    mb = fake_micro_batch(logits.detach(), [1.0, -0.5])
    loss = ClippedPgLoss(GrpoConfig(kl_coef=0.1))
    terms = loss(token_logprobs(logits, mb.batch.labels), mb)
    assert loss.tokens(mb) == 6
    assert terms.mins["probs_ratio_min"] == 1.0 == terms.maxs["probs_ratio_max"]
    assert float(terms.total.detach()) == pytest.approx(-(3 * 1.0 + 3 * -0.5))
    assert terms.sums["token_mult_prob_error"] == 6.0 and terms.sums["kl"] == 0.0 and terms.sums["clipped"] == 0
    terms.total.backward()
    assert logits.grad.abs().sum() > 0


def test_ratios_outside_the_clip_range_are_clipped():
    logits = torch.randn(2, 5, 8, generator=torch.Generator().manual_seed(1))
    mb = fake_micro_batch(logits, [1.0, 1.0], prev_shift=-1.0)  # ratio e > 1.2
    terms = ClippedPgLoss(GrpoConfig(clip_low=0.2, clip_high=0.2))(token_logprobs(logits, mb.batch.labels), mb)
    assert terms.mins["probs_ratio_min"] == pytest.approx(2.718281828, rel=1e-5)
    assert float(terms.total) == pytest.approx(-6 * 1.2, rel=1e-5)  # min(ratio A, 1.2 A) = 1.2 for A > 0
    assert terms.sums["clipped"] == 6


def test_k3_is_zero_at_equality_and_positive_elsewhere():
    a = torch.tensor([-1.0, -2.0])
    assert torch.equal(k3(a, a), torch.zeros(2)) and (k3(a, a + 0.3) > 0).all()


# ---- a rollout as plane samples ------------------------------------------------------------------
def test_sample_ids_are_unique_per_step_even_for_a_repeated_prompt():
    prompts = prompt_sample_ids(["p", "q", "p"])
    assert prompts == ["p", "q", "p~1"]
    responses = response_sample_ids(prompts, 2)
    assert responses == ["p#0", "p#1", "q#0", "q#1", "p~1#0", "p~1#1"]
    assert prompt_of(responses[2:]) == ["q", "p~1"]


def text_rollouts() -> Rollouts:
    """Two prompts (left-padded), two responses each; eos = 9, pad = 0."""
    prompt_ids = torch.tensor([[0, 5, 6], [7, 8, 6]]).repeat_interleave(2, dim=0)
    prompt_mask = torch.tensor([[0, 1, 1], [1, 1, 1]]).repeat_interleave(2, dim=0)
    response_ids = torch.tensor([[3, 9, 0], [4, 4, 4], [9, 0, 0], [2, 9, 0]])
    response_mask = torch.tensor([[1, 1, 0], [1, 1, 1], [1, 0, 0], [1, 1, 0]])
    return Rollouts(
        group_size=2,
        sample_ids=["p", "p", "q", "q"],
        answers=["3", "3", "1", "1"],
        prompt_ids=prompt_ids,
        prompt_mask=prompt_mask,
        response_ids=response_ids,
        response_mask=response_mask,
        logprobs=-torch.arange(12, dtype=torch.float32).view(4, 3) * response_mask,
        pad_token_id=0,
        token_inputs={"mm_token_type_ids": torch.zeros_like(prompt_ids)},
    )


def test_rollout_columns_unpad_prompts_and_cut_responses_at_their_end():
    r = text_rollouts()
    assert ended_with(r, [9]) == [True, False, True, True]
    terms = reward_terms(load_recipe(GRPO).grpo)
    samples = [{"answer": a} for a in r.answers]
    scored = score_responses(terms, ["3", "x", "", "2"], samples, [True] * 4, format_reward=0.0)
    written = rollout_columns(r, scored, family="qwen2_5_vl", image_token_id=None)
    assert written.prompts.sample_ids == ["p", "q"]
    assert [p.tolist() for p in written.prompts["prompt_ids"]] == [[5, 6], [7, 8, 6]]  # once per prompt
    assert written.prompts["pixel_values"] == [[], []]  # text only
    rows = join(written.prompts, written.responses)
    assert rows.sample_ids == ["p#0", "p#1", "q#0", "q#1"]
    assert [p.tolist() for p in rows["prompt_ids"]] == [[5, 6], [5, 6], [7, 8, 6], [7, 8, 6]]
    assert [x.tolist() for x in rows["response_ids"]] == [[3, 9], [4, 4, 4], [9], [2, 9]]
    assert rows["generation_logprobs"][1].tolist() == [-3.0, -4.0, -5.0]
    assert [float(x) for x in rows["rewards"]] == [1.0, 0.0, 0.0, 0.0]


def test_a_filler_prompt_s_responses_train_no_token():
    """An epoch's filler prompt (vlmrun.data.epochs) is generated for like any, but trains nothing."""
    q = filler_id("q", 1)
    r = dataclasses.replace(text_rollouts(), sample_ids=["p", "p", q, q])
    written = rollout_columns(r, [clevr_exact("", "1", True, 0.0)] * 4, family="qwen2_5_vl", image_token_id=None)
    rows = join(written.prompts, written.responses)
    assert rows.sample_ids == ["p#0", "p#1", f"{q}#0", f"{q}#1"]
    assert [m.tolist() for m in rows["response_mask"]] == [[True, True], [True] * 3, [False], [False, False]]
    (b,) = model_batches(rows, 4, family="qwen2_5_vl", pad_token_id=0, pixel_dtype=None)
    assert (b.labels[2:] == IGNORE_INDEX).all() and (b.labels[:2] != IGNORE_INDEX).sum() == 5


def test_prompt_samples_known_before_generation_are_the_ones_the_rollout_gives():
    r = text_rollouts()
    batch = PromptBatch(
        sample_ids=["p", "q"],
        input_ids=r.prompt_ids[::2],
        attention_mask=r.prompt_mask[::2],
        answers=["3", "1"],
        token_inputs={k: v[::2] for k, v in r.token_inputs.items()},
    )
    before = prompt_columns(batch, family="qwen2_5_vl", image_token_id=None)
    after = rollout_columns(r, [clevr_exact("", "1", True, 0.0)] * 4, family="qwen2_5_vl", image_token_id=None)
    assert before.sample_ids == after.prompts.sample_ids
    for name, values in after.prompts.columns.items():
        assert [v.tolist() if torch.is_tensor(v) else v for v in before[name]] == [
            v.tolist() if torch.is_tensor(v) else v for v in values
        ]


def joined_rows() -> SampleBatch:
    written = rollout_columns(
        text_rollouts(), [clevr_exact("", "1", True, 0.0)] * 4, family="qwen2_5_vl", image_token_id=None
    )
    return join(written.prompts, written.responses)


def test_micro_batches_put_prompt_then_response_and_read_values_back():
    rows = joined_rows()
    batches = model_batches(rows, 2, family="qwen2_5_vl", pad_token_id=0, pixel_dtype=None)
    assert len(batches) == 2
    b = batches[0]
    assert b.input_ids.tolist() == [[5, 6, 3, 9, 0], [5, 6, 4, 4, 4]]
    assert b.attention_mask.tolist() == [[1, 1, 1, 1, 0], [1, 1, 1, 1, 1]]
    assert b.labels.tolist() == [[-100, -100, 3, 9, -100], [-100, -100, 4, 4, 4]]
    values = [torch.tensor([0.5, 0.25]), torch.tensor([1.0, 2.0, 3.0])]
    assert sequence_starts(b) == [(0, 0), (1, 0)]
    placed = place_response_values(values, sequence_starts(b), [2, 2], tuple(b.input_ids.shape))
    assert placed.tolist() == [[0.0, 0.5, 0.25, 0.0], [0.0, 1.0, 2.0, 3.0]]
    assert [v.tolist() for v in response_values(placed, [(0, 0), (1, 0)], [2, 2], [2, 3])] == [
        [0.5, 0.25],
        [1.0, 2.0, 3.0],
    ]


def test_packed_micro_batches_put_sequences_end_to_end_and_read_values_back():
    rows = joined_rows()  # prompts [5, 6] x 2 and [7, 8, 6] x 2; responses [3, 9], [4, 4, 4], [9], [2, 9]
    (b,) = model_batches(rows, 4, family="qwen2_5_vl", pad_token_id=0, pixel_dtype=None, pack_tokens=9)
    assert b.input_ids.tolist() == [[5, 6, 3, 9, 5, 6, 4, 4, 4], [7, 8, 6, 9, 7, 8, 6, 2, 9]]
    assert b.attention_mask.tolist() == [[1, 1, 1, 1, 2, 2, 2, 2, 2]] * 2 and b.is_packed
    assert b.labels.tolist() == [[-100, -100, 3, 9, -100, -100, 4, 4, 4], [-100, -100, -100, 9, -100, -100, -100, 2, 9]]
    assert sequence_starts(b) == [(0, 0), (0, 4), (1, 0), (1, 4)]
    values = [torch.tensor([0.5, 0.25]), torch.tensor([1.0, 2.0, 3.0]), torch.tensor([7.0]), torch.tensor([8.0, 9.0])]
    placed = place_response_values(values, sequence_starts(b), [2, 2, 3, 3], tuple(b.input_ids.shape))
    assert placed.tolist() == [[0.0, 0.5, 0.25, 0.0, 0.0, 1.0, 2.0, 3.0], [0.0, 0.0, 7.0, 0.0, 0.0, 0.0, 8.0, 9.0]]
    assert [v.tolist() for v in batch_response_values(placed, b, rows, 0)] == [v.tolist() for v in values]
    with pytest.raises(ValueError, match="does not fit a packed row of 4"):
        model_batches(rows, 4, family="qwen2_5_vl", pad_token_id=0, pixel_dtype=None, pack_tokens=4)


def test_train_micro_batches_carry_advantages_and_logprobs_on_the_response():
    rows = joined_rows()
    n = [len(x) for x in rows["response_ids"]]
    rows.columns["prev_logprobs"] = [torch.full((k,), -1.0) for k in n]
    rows.columns["advantages"] = [torch.tensor(float(i)) for i in range(4)]
    mbs = pg_micro_batches(rows, 2, family="qwen2_5_vl", pad_token_id=0, pixel_dtype=None)
    assert mbs[1].advantages.tolist() == [[0.0, 0.0, 2.0, 0.0], [0.0, 0.0, 3.0, 3.0]] and mbs[1].ref_logprobs is None
    assert mbs[1].mask.tolist() == [[False, False, True, False], [False, False, True, True]]  # next-token positions
    assert mbs[1].prev_logprobs[mbs[1].mask].tolist() == [-1.0] * 3


def test_the_partition_round_trip_is_exact_and_each_stage_reads_its_fields():
    recipe = load_recipe(GRPO)
    written = rollout_columns(
        text_rollouts(), [clevr_exact("", "1", True, 0.0)] * 4, family="qwen2_5_vl", image_token_id=None
    )
    plane = LocalDataPlane()
    part = partition_name(3, 1)
    plane.register(part, rollout_spec(recipe, 6))
    plane.put(part, written.prompts.sample_ids, written.prompts.columns)
    plane.put(part, written.responses.sample_ids, written.responses.columns)
    prompt_fields, response_fields = split_fields(stage_fields(recipe, GrpoStage.LOGPROB))
    assert prompt_fields == ["prompt_ids", "mm_token_type_ids", "pixel_values", "image_grid_thw"]
    ids = written.responses.sample_ids
    got = join(plane.get(part, prompt_of(ids), prompt_fields), plane.get(part, ids, response_fields))
    rows = join(written.prompts, written.responses)
    direct = SampleBatch(rows.sample_ids, {k: rows.columns[k] for k in got.columns})
    layout = dict(family="qwen2_5_vl", pad_token_id=0, pixel_dtype=None)
    for a, b in zip(model_batches(got, 2, **layout), model_batches(direct, 2, **layout), strict=True):
        assert torch.equal(a.input_ids, b.input_ids) and torch.equal(a.labels, b.labels)
    assert "ref_logprobs" not in stage_fields(recipe, GrpoStage.TRAIN)  # no KL: nobody writes it
    assert stage_fields(recipe, GrpoStage.ADVANTAGE) == ("rewards",)
    assert value_bytes({"rewards": written.responses["rewards"]}) == 16


def test_a_stage_reads_the_rollout_apart_from_what_was_written_since():
    recipe = load_recipe(GRPO)
    ids = ["grpo-s3-r1-p0#0", "grpo-s3-r1-p0#1"]
    train = StageGets.of(recipe, "part", ids, GrpoStage.TRAIN)
    assert train.rollout.fields == ["response_ids", "response_mask", "generation_logprobs"]
    assert train.later.fields == ["prev_logprobs", "advantages"]  # no KL: no ref_logprobs
    assert train.prompts.sample_ids == prompt_of(ids) and "pixel_values" in train.prompts.fields
    assert sorted(f for g in train.all() for f in g.fields) == sorted(stage_fields(recipe, GrpoStage.TRAIN))
    logprob = StageGets.of(recipe, "part", ids, GrpoStage.LOGPROB)
    assert logprob.later is None and len(logprob.all()) == 2
    kl = StageGets.of(
        recipe.model_copy(update={"grpo": recipe.grpo.model_copy(update={"kl_coef": 0.1})}), "p", ids, GrpoStage.TRAIN
    )
    assert kl.later.fields == ["prev_logprobs", "ref_logprobs", "advantages"]
    one = [torch.ones(2)] * 2
    got = StageGets.joined(
        [
            SampleBatch(ids, {"response_ids": one}),
            SampleBatch(ids, {"advantages": [torch.tensor(1.0)] * 2}),
            SampleBatch(prompt_of(ids)[:1], {"prompt_ids": [torch.zeros(3)]}),
        ]
    )
    assert got.sample_ids == ids and sorted(got.columns) == ["advantages", "prompt_ids", "response_ids"]
    assert len(got["prompt_ids"]) == 2  # each response with its prompt's


def test_stage_plane_runs_queued_calls_in_order_and_raises_their_errors_at_the_next_wait():
    plane = StagePlane(LocalDataPlane(), None)
    reward = {"rewards": [torch.tensor(1.0)]}
    plane.register("p", PartitionSpec.reading({"advantage": ["rewards"]}, 4), wait=False)
    plane.put_many([Put("p", ["a"], reward)], wait=False)  # after the register: in order
    plane.prefetch([Get("p", ["a"], ["rewards"])])
    assert plane.get_many([Get("p", ["a"], ["rewards"])])[0].stack("rewards").tolist() == [1.0]
    plane.put_many([Put("p", ["a"], reward)], wait=False)  # refused when it runs: already written
    with pytest.raises(DataPlaneError, match="already written"):
        plane.get_many([Get("p", ["a"], ["rewards"])])
    plane.put_many([Put("p", ["b"], {"logits": [torch.zeros(1)]})], wait=False)
    with pytest.raises(DataPlaneError, match="unknown field"):
        plane.flush()
    plane.prefetch([Get("p", ["a"], ["rewards"])])
    plane.clear("p", wait=False)  # drops the prefetch nobody took
    plane.flush()
    assert plane.plane.partitions() == [] and plane.take()["bytes"] == 2 * 4  # the put and the get that went through
    with pytest.raises(DataPlaneError, match="no partition"):
        plane.serve("get", "p", ["a"], ["rewards"])  # for another process: its error is that caller's alone
    plane.flush()
    plane.close()


# ---- the recipe ----------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "overrides, field, words",
    [
        (["grpo.inner_steps=3"], "grpo.inner_steps", "must divide"),
        (["grpo.num_generations=1"], "grpo.num_generations", "greater than or equal to 2"),
        (["grpo.temperature=0"], "grpo.temperature", "greater than 0"),
        (["data_plane.backend=mooncake"], "data_plane", "transfer_queue"),
    ],
)
def test_bad_grpo_recipes_are_refused_naming_the_field(overrides, field, words):
    with pytest.raises(InputError) as e:
        load_recipe(GRPO, overrides)
    assert field in str(e.value) and words in str(e.value)


def test_sft_refuses_what_only_grpo_runs():
    tiny = ROOT / "recipes" / "tiny-clevr-cpu.yaml"
    with pytest.raises(InputError, match="data_plane.impl"):
        load_recipe(tiny, ["data_plane.impl=transfer_queue"])
    with pytest.raises(InputError, match="data_plane.enabled"):
        load_recipe(tiny, ["data_plane.enabled=false"])


def test_the_task_encoder_must_feed_the_algorithm():
    from vlmrun.data.components import check_components

    with pytest.raises(InputError, match="use chat_grpo") as e:
        check_components(load_recipe(GRPO, ["data.task_encoder=chat_sft"]))
    assert e.value.field == "data.task_encoder"
    with pytest.raises(InputError, match="use chat_sft"):
        check_components(load_recipe(ROOT / "recipes" / "tiny-clevr-cpu.yaml", ["data.task_encoder=chat_grpo"]))
    check_components(load_recipe(GRPO, ["data_plane.impl=transfer_queue", "data_plane.backend=mooncake"]))


@pytest.mark.parametrize(
    "name", ["tiny-grpo-cpu.yaml", "qwen2.5-vl-3b-clevr-grpo-1n2g.yaml", "omni-clevr-grpo-1n8g.yaml"]
)
def test_shipped_grpo_recipes_validate(name):
    from vlmrun.data.components import check_components

    r = load_recipe(ROOT / "recipes" / name)
    check_components(r)
    assert r.train.algorithm == "grpo" and r.data.task_encoder == "chat_grpo"


def test_a_local_mooncake_plane_needs_mooncake_here(monkeypatch):
    import vlmrun.cluster.mooncake as mooncake
    from vlmrun.cluster.preflight import check_local_mooncake

    recipe = load_recipe(GRPO, ["data_plane.impl=transfer_queue", "data_plane.backend=mooncake"])
    monkeypatch.setattr(mooncake, "mooncake_unavailable", lambda: "mooncake_master is not installed")
    with pytest.raises(InputError, match="data_plane.backend: mooncake: mooncake_master is not installed"):
        check_local_mooncake(recipe.data_plane)
    disabled = load_recipe(
        GRPO, ["data_plane.enabled=false", "data_plane.impl=transfer_queue", "data_plane.backend=mooncake"]
    )
    check_local_mooncake(disabled.data_plane)  # no plane, no server
