"""A GRPO prompt's images go through the vision tower once per stage, however many responses it has
(models/shared_images.py), and the responses get the log-probs, samples and gradients that encoding
each copy gave: in generation, in the logprob stages and in training, for every family; and so do
the stages' packed rows (data.pack_tokens), to fp32 round-off, for the Qwen-VL families."""

from __future__ import annotations

import pytest
import torch
from data_samples import FAMILIES, free_port, make_recipe, rank_policy, read_raw_samples

from vlmrun.algorithms.grpo.micro_batches import (
    batch_response_values,
    model_batches,
    pg_micro_batches,
    sequence_lengths,
    token_groups,
)
from vlmrun.algorithms.grpo.rollout_rows import join, rollout_columns
from vlmrun.config.families import family_spec
from vlmrun.data.chat_encoding import ConversationEncoder
from vlmrun.data.cookers import cook_conversation
from vlmrun.data.loader import load_processor
from vlmrun.data.packing import rows_in_order
from vlmrun.generation.hf import HfGenerator
from vlmrun.generation.interface import SamplingParams
from vlmrun.models.packing import packing_refusal
from vlmrun.models.shared_images import share_images
from vlmrun.models.spec import ModelSpec
from vlmrun.rewards.builtin import Scored

KEYS = ("train-0000000", "train-0000001", "train-0000002")
G = 3
SAMPLING = SamplingParams(temperature=1.0, top_p=1.0, max_new_tokens=6, seed=7)


def image(rows: int, value: float, grid: list[int]) -> dict[str, torch.Tensor]:
    return {"pixel_values": torch.full((rows, 4), value), "image_grid_thw": torch.tensor([grid])}


def test_each_groups_pixels_once_every_rows_grid_and_where_each_image_comes_from():
    a, b = image(4, 1.0, [1, 2, 2]), image(8, 2.0, [1, 2, 4])
    two = {k: torch.cat([a[k], b[k]]) for k in a}  # a prompt with two images
    media, source = share_images(
        [a, a, {}, two, two, a], ["p", "p", "t", "q", "q", "p"], pixels="pixel_values", grid="image_grid_thw"
    )
    assert torch.equal(media["pixel_values"], torch.cat([a["pixel_values"], two["pixel_values"]]))
    assert media["image_grid_thw"].tolist() == [[1, 2, 2]] * 2 + [[1, 2, 2], [1, 2, 4]] * 2 + [[1, 2, 2]]
    assert source == (0, 0, 1, 2, 1, 2, 0)
    # nothing repeats: the plain layout, nothing for the model to share
    media, source = share_images([a, b], ["p", "q"], pixels="pixel_values", grid="image_grid_thw")
    assert source is None and media["pixel_values"].shape[0] == 12
    with pytest.raises(ValueError, match="rows of group 'p' hold different images"):
        share_images([a, image(4, 3.0, [1, 2, 2])], ["p", "p"], pixels="pixel_values", grid="image_grid_thw")


@pytest.fixture(scope="module")
def prompts_of(clevr_set, tiny_dirs):
    """family -> the left-padded batch of three CLEVR prompts with one image each."""
    raw = read_raw_samples(clevr_set, "train")

    def make(family: str):
        encoder = ConversationEncoder(load_processor(tiny_dirs[family], family), family_spec(family), max_seq_len=256)
        return encoder.collate_prompts([encoder.encode_prompt(cook_conversation(raw[k])) for k in KEYS])

    return make


def vision_rows(model: torch.nn.Module) -> list[int]:
    """The patch rows each call of `model`'s vision tower is given, appended as they come."""
    tower = next(m for name, m in model.named_modules() if name.endswith(("visual", "vision_model")))
    seen: list[int] = []
    tower.register_forward_pre_hook(lambda module, args: seen.append(args[0].shape[0]))
    return seen


@pytest.mark.parametrize("family", FAMILIES)
def test_generation_encodes_each_prompts_images_once_and_samples_the_same(family, prompts_of, tiny_dirs):
    prompts = prompts_of(family)
    got = {}
    for share in (True, False):
        g = HfGenerator(model=ModelSpec(directory=tiny_dirs[family]), share_images=share)
        g.setup()
        rows = vision_rows(g.model)
        got[share] = g.generate(prompts, SAMPLING, n=G), rows
    (shared, shared_rows), (plain, plain_rows) = got[True], got[False]
    assert len(shared_rows) == len(plain_rows) == 1  # the prefill
    assert plain_rows[0] == G * shared_rows[0] == G * prompts.media["pixel_values"].shape[0]
    assert torch.equal(shared.response_ids, plain.response_ids)
    assert torch.allclose(shared.logprobs, plain.logprobs, rtol=0, atol=1e-5)
    for k, v in plain.media.items():  # the rollouts still carry every row's media for the planes
        assert torch.equal(shared.media[k], v)


def stage_inputs(family: str, prompts_of, clevr_set, tiny_dirs):
    """The joined rollout columns of G responses to each of the CLEVR prompts, the rank's policy, and
    the padded layout of `model_batches`."""
    g = HfGenerator(model=ModelSpec(directory=tiny_dirs[family]))
    g.setup()
    rollouts = g.generate(prompts_of(family), SAMPLING, n=G)
    scored = [Scored(reward=float(i % 2), correct=False, well_formed=True) for i in range(len(rollouts))]
    written = rollout_columns(rollouts, scored, family=family, image_token_id=g.image_token_id)
    policy, _ = rank_policy(make_recipe(clevr_set, family=family), 0, 1, tiny_dirs[family], {}, free_port())
    layout = {"family": family, "pad_token_id": g.pad_token_id, "pixel_dtype": None}
    return join(written.prompts, written.responses), policy, layout


@pytest.mark.parametrize("family", FAMILIES)
def test_the_logprob_and_train_stages_encode_each_prompts_images_once_with_the_same_values(
    family, prompts_of, clevr_set, tiny_dirs
):
    got, policy, layout = stage_inputs(family, prompts_of, clevr_set, tiny_dirs)
    rows = 2 * G  # two prompts' responses per micro-batch, the last holds one prompt's
    seen = vision_rows(policy.model)

    shared = model_batches(got, rows, **layout)
    plain = model_batches(got, rows, **layout, share_images=False)
    assert [b.image_source for b in shared] == [(0, 0, 0, 1, 1, 1), (0, 0, 0)]
    assert all(b.image_source is None for b in plain)
    for s, p in zip(shared, plain, strict=True):
        seen.clear()
        a = policy.logprobs(s)
        shared_rows = list(seen)
        seen.clear()
        b = policy.logprobs(p)
        assert shared_rows[0] * G == seen[0]
        assert torch.allclose(a, b, rtol=0, atol=1e-5)
        assert torch.equal(a, policy.logprobs(s))  # what makes GRPO's ratio exactly 1

    grads = {}
    for share in (True, False):  # the loss's gradient of the whole model, the vision tower's included
        mbs = pg_micro_batches(
            _with_train_columns(got, policy, layout), rows, **layout, **({} if share else {"share_images": False})
        )
        policy.model.zero_grad(set_to_none=True)
        for mb in mbs:
            logp = policy._logprobs(policy.model, mb)  # the train step's own forward
            (-(logp * mb.advantages)[mb.mask].sum()).backward()
        grads[share] = {n: p.grad.clone() for n, p in policy.model.named_parameters() if p.grad is not None}
    tower = [n for n in grads[True] if ".visual." in f".{n}" or "vision" in n]
    assert tower and grads[True].keys() == grads[False].keys()
    for n, v in grads[False].items():
        assert torch.allclose(grads[True][n], v, rtol=1e-4, atol=1e-6), n


def _with_train_columns(got, policy, layout):
    """`got` with what the train stage reads beside it: advantages and the logprob columns."""
    columns = dict(got.columns)
    prev = []
    start = 0
    for b in model_batches(got, len(got), **layout):
        prev += batch_response_values(policy.logprobs(b), b, got, start)
        start += len(b)
    columns["prev_logprobs"] = prev
    columns["generation_logprobs"] = prev
    columns["advantages"] = [torch.tensor(float(i % 3) - 1.0) for i in range(len(got))]
    return type(got)(sample_ids=list(got.sample_ids), columns=columns)


@pytest.mark.parametrize("family", [f for f in FAMILIES if packing_refusal(f) is None])  # not Mamba's
def test_packed_stages_give_the_padded_logprobs_and_gradients_and_read_their_images_once(
    family, prompts_of, clevr_set, tiny_dirs
):
    """GRPO with `data.pack_tokens`: a micro-batch's responses end to end in rows (micro_batches.py, 2);
    with `data.pack_by: tokens` the samples fill one-row micro-batches of the budget instead, one more
    than they need here (the fullest split): the same values and gradients."""
    got, policy, padded = stage_inputs(family, prompts_of, clevr_set, tiny_dirs)
    longest = max(p.numel() + r.numel() for p, r in zip(got["prompt_ids"], got["response_ids"], strict=True))
    rows = 2 * G
    seen = vision_rows(policy.model)
    packed = {**padded, "pack_tokens": 3 * longest}
    need = len(rows_in_order(sequence_lengths(got), 3 * longest))
    budget = {**packed, "groups": token_groups(got, 3 * longest, need + 1)}
    assert len(budget["groups"]) == need + 1 and [i for g in budget["groups"] for i in g] == list(range(len(got)))
    layouts = {"padded": padded, "packed": packed, "budget": budget}

    values, tower = {}, {}
    for name, layout in layouts.items():
        batches = model_batches(got, rows, **layout)
        seen.clear()
        values[name], start = [], 0
        for b in batches:
            scores = policy.logprobs(b)
            assert torch.equal(scores, policy.logprobs(b))  # what makes GRPO's ratio exactly 1
            values[name] += batch_response_values(scores, b, got, start)
            start += len(b)
        tower[name] = list(seen)
        if name == "packed":  # 2 prompts x G responses in 2 rows of 3 sequences, then G in 1 row
            assert [b.input_ids.shape[0] for b in batches] == [2, 1] and all(b.is_packed for b in batches)
    assert tower["packed"] == tower["padded"]  # each prompt's image through the tower once, packed or not
    for way in ("packed", "budget"):
        for a, b in zip(values[way], values["padded"], strict=True):
            assert a.shape == b.shape and torch.allclose(a, b, rtol=0, atol=1e-5)

    grads, sums = {}, {}
    for name, layout in layouts.items():
        policy.model.zero_grad(set_to_none=True)
        total = 0.0
        for mb in pg_micro_batches(_with_train_columns(got, policy, padded), rows, **layout):
            logp = policy._logprobs(policy.model, mb)  # the train step's own forward
            loss = -(logp * mb.advantages)[mb.mask].sum()
            loss.backward()
            total += float(loss.detach())
        sums[name] = total
        grads[name] = {n: p.grad.clone() for n, p in policy.model.named_parameters() if p.grad is not None}
    for way in ("packed", "budget"):
        assert sums[way] == pytest.approx(sums["padded"], rel=1e-5, abs=1e-5)
        assert grads[way].keys() == grads["padded"].keys()
        for n, v in grads["padded"].items():
            assert torch.allclose(grads[way][n], v, rtol=1e-4, atol=1e-5), (way, n, (grads[way][n] - v).abs().max())
