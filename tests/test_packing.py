"""Sequences packed end to end into rows (data/packing.py, models/packing.py) give each sequence the
log-probs, loss and gradients it gets in a padded row of its own, to fp32 round-off, for each Qwen-VL
family: on rows mixing sequences with no image, one and two images; a packed sequence's mRoPE ids are
those the model computes for it alone. Nemotron-Omni's Mamba layers cannot be packed: refused, with why."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest
import torch
from data_samples import FAMILIES, free_port, make_recipe, rank_policy, read_raw_samples
from shared_runs import submit, submit_args
from vlmrun_cli import GRPO, TINY, Launcher, sealed, sets, states, vlmrun, wait_for

from vlmrun.config.families import family_spec
from vlmrun.config.load import load_recipe
from vlmrun.data.batch import IGNORE_INDEX
from vlmrun.data.chat_encoding import ConversationEncoder
from vlmrun.data.cookers import cook_conversation
from vlmrun.data.loader import load_processor
from vlmrun.data.packing import by_tokens, pack, padding_fraction, rows_for, rows_in_order, unpack
from vlmrun.errors import InputError
from vlmrun.models.fit import training_shape
from vlmrun.models.packing import (
    packed_inputs,
    packed_position_ids,
    packing_refusal,
    runs_as_one_row,
    sequences_in_rows,
)
from vlmrun.policy.loss import NllLoss, labelled_logprobs, scored_positions
from vlmrun.run.metrics import history

PACKED = [f for f in FAMILIES if packing_refusal(f) is None]
KEYS = ("train-0000000", "train-0000001", "train-0000002", "train-0000003")


def test_rows_are_filled_in_order_and_a_sequence_longer_than_a_row_is_refused():
    assert rows_in_order([5, 3, 4, 2, 6], 8) == [[0, 1], [2, 3], [4]]
    assert rows_in_order([8, 1], 8) == [[0], [1]]
    with pytest.raises(ValueError, match="a sequence of 9 tokens does not fit a packed row of 8"):
        rows_in_order([3, 9], 8)


def test_by_tokens_lays_a_steps_sequences_out_again_as_rows_of_the_budget(encoded):
    """`data.pack_by: tokens`: a rank's micro-batches of a step (packed by samples) become `count`
    one-row micro-batches of at most the budget, the same sequences (tokens, labels, per-token inputs,
    images with their pixel rows) in the same order; more micro-batches than the rows need split the
    fullest row, never fewer than it needs nor more than there are sequences."""
    encoder, samples = encoded["qwen2_5_vl"]
    family = encoder.family
    lengths = [s.input_ids.numel() for s in samples]
    budget = max(lengths[0] + lengths[1], lengths[2] + lengths[3])
    loaded = [pack(samples[k : k + 2], row_tokens=max(lengths), pad_token_id=0, family=family) for k in (0, 2)]
    assert [b.input_ids.shape[0] for b in loaded] == [2, 2]  # one sequence a row: padded-like
    assert rows_for(loaded, budget) == 2
    for count in (2, 3, 4):
        got = by_tokens(loaded, row_tokens=budget, count=count, pad_token_id=0, family=family)
        assert len(got) == count and all(b.input_ids.shape[0] == 1 and b.input_ids.shape[1] <= budget for b in got)
        again = [seq for b in got for seq in unpack(b, family)]
        assert [seq.key for seq in again] == [s.key for s in samples]
        for seq, s in zip(again, samples, strict=True):
            assert torch.equal(seq.input_ids, s.input_ids) and torch.equal(seq.labels[1:], s.labels[1:])
            assert seq.token_inputs.keys() == s.token_inputs.keys()
            assert all(torch.equal(seq.token_inputs[k], s.token_inputs[k]) for k in s.token_inputs)
            assert seq.media.keys() == s.media.keys() and all(torch.equal(seq.media[k], s.media[k]) for k in s.media)
    for count in (1, 5):
        with pytest.raises(ValueError, match="sequences fill 2 rows"):
            by_tokens(loaded, row_tokens=budget, count=count, pad_token_id=0, family=family)


def test_the_packable_families_and_the_refused_one():
    assert PACKED == [f for f in FAMILIES if f != "nemotron_omni"]
    assert "Mamba" in packing_refusal("nemotron_omni")


@pytest.fixture(scope="module")
def encoded(clevr_set, tiny_dirs):
    """family -> (encoder, samples with one image, two images, none, one), the CLEVR set's conversations."""
    raw = read_raw_samples(clevr_set, "train")
    out = {}
    for family in FAMILIES:
        encoder = ConversationEncoder(load_processor(tiny_dirs[family], family), family_spec(family), max_seq_len=256)
        convs = [cook_conversation(raw[k]) for k in KEYS]
        user = convs[1].messages[0]["content"]
        two_images = [
            {"type": "image", "media": 0},
            {"type": "image", "media": 1},
            *[p for p in user if p["type"] == "text"],
        ]
        two = dataclasses.replace(
            convs[1],
            messages=[{"role": "user", "content": two_images}, *convs[1].messages[1:]],
            media=[convs[1].media[0], convs[3].media[0]],
        )
        text = dataclasses.replace(
            convs[2],
            messages=[
                {"role": "user", "content": [p for p in convs[2].messages[0]["content"] if p["type"] == "text"]},
                *convs[2].messages[1:],
            ],
            media=[],
        )
        samples = [encoder.encode(c) for c in (convs[0], two, text, convs[3])]
        assert [s.media[family_spec(family).media_keys[1]].shape[0] if s.media else 0 for s in samples] == [1, 2, 0, 1]
        out[family] = encoder, samples
    return out


def test_pack_lays_sequences_end_to_end_and_keeps_their_boundaries(encoded):
    encoder, samples = encoded["qwen2_5_vl"]
    lengths = [s.input_ids.numel() for s in samples]
    row = lengths[0] + lengths[1]
    batch = pack(samples, row_tokens=row, pad_token_id=encoder.pad_token_id, family=encoder.family)
    layout = rows_in_order(lengths, row)
    spans = sequences_in_rows(batch.attention_mask)
    assert [[n for _, n in r] for r in spans] == [[lengths[i] for i in r] for r in layout] and len(spans[0]) == 2
    assert batch.sample_ids == [s.key for s in samples] and batch.is_packed
    placed = [(r, at, n) for r, row in enumerate(spans) for at, n in row]
    for (r, at, n), s in zip(placed, samples, strict=True):  # each sequence's tokens and labels, its first ignored
        assert torch.equal(batch.input_ids[r, at : at + n], s.input_ids)
        assert batch.labels[r, at] == IGNORE_INDEX and torch.equal(batch.labels[r, at + 1 : at + n], s.labels[1:])
    assert padding_fraction(batch) < padding_fraction(encoder.collate(samples))
    with pytest.raises(ValueError, match="packed_inputs"):
        batch.model_inputs()


@pytest.mark.parametrize("family", PACKED)
def test_packed_sequences_get_their_padded_logprobs_loss_gradients_and_mrope_ids(family, encoded, clevr_set, tiny_dirs):
    encoder, samples = encoded[family]
    padded = encoder.collate(samples)
    packed = pack(
        samples,
        row_tokens=sum(s.input_ids.numel() for s in samples[:3]),
        pad_token_id=encoder.pad_token_id,
        family=encoder.family,
    )
    assert [len(r) for r in sequences_in_rows(packed.attention_mask)] == [3, 1]  # 1 + 2 + 0 images, then 1
    policy, _ = rank_policy(make_recipe(clevr_set, family=family), 0, 1, tiny_dirs[family], {}, free_port())
    model = policy.model

    # mRoPE: what the model itself computes for each sequence alone, read at its language model's input
    seen = []
    text_model = next(m for n, m in model.named_modules() if n.endswith("language_model"))
    hook = text_model.register_forward_pre_hook(lambda m, args, kw: seen.append(kw["position_ids"]), with_kwargs=True)
    alone = []
    with torch.no_grad():
        for s in samples:
            one = encoder.collate([s])
            model(**one.model_inputs(), use_cache=False)
            ids = seen.pop()  # None for a text-only sequence: the text model counts 0, 1, ... on each axis
            n = s.input_ids.numel()
            alone.append(torch.arange(n).expand(3, n) if ids is None else ids[-3:, 0])
    hook.remove()
    positions = packed_position_ids(model, packed)
    where = _where(packed, samples)
    for i, (r, a, n) in enumerate(where):
        assert torch.equal(positions[1:, r, a : a + n], alone[i]), samples[i].key
        assert torch.equal(positions[0, r, a : a + n], torch.arange(n))

    want, got = policy.logprobs(padded), policy.logprobs(packed)
    for i, (r, a, n) in enumerate(where):
        assert torch.allclose(got[r, a : a + n - 1], want[i, : n - 1], rtol=0, atol=1e-5), samples[i].key
    assert got.abs().sum() > 0

    # flash-attention's layout (runs_as_one_row): the rows end to end as one row, the same log-probs
    keep = scored_positions(packed.labels)
    with torch.no_grad():
        one = packed_inputs(model, packed, one_row=True)
        assert one["input_ids"].shape == (1, packed.input_ids.numel())
        logits = model(**one, use_cache=False, logits_to_keep=keep.reshape(1, -1)).logits
    assert torch.allclose(labelled_logprobs(logits, packed.labels), got, rtol=0, atol=1e-5)

    grads = []
    for batch in (padded, packed):
        model.zero_grad(set_to_none=True)
        loss = NllLoss()(policy._logprobs(model, batch), batch).total
        loss.backward()
        grads.append(
            (float(loss.detach()), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
        )
    (loss_padded, g_padded), (loss_packed, g_packed) = grads
    assert NllLoss().tokens(packed) == NllLoss().tokens(padded)
    assert loss_packed == pytest.approx(loss_padded, rel=1e-5)
    assert g_packed.keys() == g_padded.keys()
    for n, v in g_padded.items():
        assert torch.allclose(g_packed[n], v, rtol=1e-4, atol=1e-6), n
    policy.shutdown()


def test_a_flash_attention_model_takes_a_packed_batch_as_one_row():
    """transformers' flash-attention path finds packed sequences from the position ids of a one-row
    batch only (several rows would each run as one causal sequence): such a model gets one row."""
    flash, sdpa = (
        SimpleNamespace(config=SimpleNamespace(_attn_implementation=a)) for a in ("flash_attention_2", "sdpa")
    )
    assert runs_as_one_row(flash) and not runs_as_one_row(sdpa)


def test_nemotron_is_not_packed(encoded, tiny_dirs):
    from transformers import AutoModelForImageTextToText

    encoder, samples = encoded["nemotron_omni"]
    batch = pack(samples, row_tokens=1024, pad_token_id=encoder.pad_token_id, family=encoder.family)
    model = AutoModelForImageTextToText.from_pretrained(tiny_dirs["nemotron_omni"])
    with pytest.raises(TypeError, match="Mamba layers carry their state"):
        packed_inputs(model, batch)


def _where(batch, samples) -> list[tuple[int, int, int]]:
    """(row, offset, tokens) of each of `samples` in packed `batch` (they keep the samples' order)."""
    spans = [(r, at, n) for r, row in enumerate(sequences_in_rows(batch.attention_mask)) for at, n in row]
    assert [n for _, _, n in spans] == [s.input_ids.numel() for s in samples]
    return spans


PACKED_STEPS = 16


@pytest.mark.slow  # two short runs and a resume through the CLI (~90 s)
def test_a_packed_run_trains_the_padded_numbers_and_v1_killed_and_resumed_equals_v2(tmp_path, finished_run, run_data):
    """`data.pack_tokens` lays each micro-batch out packed, and `data.pack_by: tokens` lays each rank's
    samples of a step out again as rows of the budget (here each rank's 2 micro-batches of 2 samples
    become 1 row of up to 1024 tokens, the count agreed over the 2 ranks): the same samples in the same
    order, so the run trains the padded run's numbers to float round-off. A packed SFT v1 run SIGKILLed
    once it sealed step 4 and resumed with `vlmrun resume` equals the uninterrupted packed v2 run
    bitwise at every step (the loader's position and the packed layout come back exactly)."""
    quick = [f"train.max_steps={PACKED_STEPS}", "checkpoint.save_period=2", "train.val_samples=0"]
    budget = ["data.pack_tokens=1024", "data.pack_by=tokens"]
    packed = sets(*quick, "data.num_workers=0", "train.lr_schedule=constant", *budget)
    v2 = history(submit(tmp_path / "v2", *run_data, *packed) / "metrics.jsonl")
    run = tmp_path / "v1"
    launcher = Launcher(tmp_path, *submit_args(run, *run_data, *packed, *sets("train.loop=v1")))
    try:
        wait_for(lambda: 4 in sealed(run) or launcher.proc.poll() is not None, 300, "the checkpoint of step 4")
        assert 4 in sealed(run), launcher.stderr()[-3000:]
    finally:
        launcher.kill_group()
        launcher.proc.wait()
    resumed = vlmrun("resume", str(run), "--wait")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert states(run)[0] == "KILLED" and states(run)[-1] == "COMPLETED"
    v1 = history(run / "metrics.jsonl")
    padded = history(finished_run / "metrics.jsonl")
    assert sorted(v1) == sorted(v2) == list(range(1, PACKED_STEPS + 1)) and sorted(padded) == [1, 2, 3, 4]
    for step, row in padded.items():  # a constant LR: the padded run's 4 steps are these runs' first 4
        assert v2[step]["sample_ids"] == row["sample_ids"] and v2[step]["valid_tokens"] == row["valid_tokens"]
        assert v2[step]["loss"] == pytest.approx(row["loss"], rel=1e-6), step
        assert v2[step]["grad_norm"] == pytest.approx(row["grad_norm"], rel=1e-5), step
    for step, row in v2.items():
        assert (v1[step]["loss"], v1[step]["grad_norm"]) == (row["loss"], row["grad_norm"]), step
        assert v1[step]["sample_ids"] == row["sample_ids"], step


@pytest.mark.parametrize(
    "overrides, words",
    [
        (["data.pack_tokens=100"], "must be at least data.max_seq_len = 256"),
        (["data.pack_tokens=512", "model.family=nemotron_omni"], "cannot pack model.family 'nemotron_omni': its Mamba"),
    ],
)
def test_a_recipe_that_cannot_pack_is_refused_naming_the_field(overrides, words):
    with pytest.raises(InputError, match="data.pack_tokens") as e:
        load_recipe(TINY, overrides)
    assert words in str(e.value)


def test_grpo_packs_rows_that_hold_a_prompt_and_its_longest_response():
    with pytest.raises(InputError, match="data.pack_tokens") as e:
        load_recipe(GRPO, ["data.pack_tokens=256"])
    assert "must be at least data.max_seq_len + grpo.max_new_tokens = 264" in str(e.value)
    assert load_recipe(GRPO, ["data.pack_tokens=264"]).data.pack_tokens == 264
    with pytest.raises(InputError, match="data.pack_by: 'tokens' .* needs grpo.inner_steps: 1"):
        load_recipe(GRPO, ["data.pack_tokens=264", "data.pack_by=tokens", "grpo.inner_steps=2"])
    assert load_recipe(GRPO, ["data.pack_tokens=264", "data.pack_by=tokens"]).data.pack_by == "tokens"
    with pytest.raises(InputError, match="data.pack_by: 'tokens' .* needs data.pack_tokens"):
        load_recipe(TINY, ["data.pack_by=tokens"])


def test_the_memory_check_counts_a_micro_batch_of_the_budget_by_tokens():
    by_samples = load_recipe(TINY, ["data.pack_tokens=1024"])
    by_budget = load_recipe(TINY, ["data.pack_tokens=1024", "data.pack_by=tokens"])
    assert training_shape(by_samples)[0].sequences == 2 and training_shape(by_budget)[0].sequences == 4


@pytest.mark.slow  # a short GRPO run through the CLI (~40 s)
def test_a_packed_grpo_run_keeps_the_ratio_at_one_and_trains_the_padded_runs_first_step(tmp_path, grpo_sets, grpo_want):
    """GRPO's logprob and train stages with `data.pack_tokens` and `data.pack_by: tokens`
    (algorithms/grpo/micro_batches.py: each rank's 16 responses fill one-row micro-batches of at most
    1056 tokens, as many on both ranks): the rollouts of step 1 come from the same weights, so its
    rewards are the padded run's and its loss and gradient norm equal the padded run's to float
    round-off; with one inner step the ratio is exactly 1."""
    budget = sets("train.max_steps=2", "data.pack_tokens=1056", "data.pack_by=tokens")
    run = submit(tmp_path / "run", *grpo_sets, *budget, recipe=GRPO)
    got, want = history(run / "metrics.jsonl"), history(grpo_want / "metrics.jsonl")
    assert sorted(got) == [1, 2]
    for row in got.values():
        assert row["probs_ratio_min"] == 1.0 == row["probs_ratio_max"] and row["grad_norm"] > 0
    for key in ("sample_ids", "reward", "advantage_mean", "valid_tokens"):
        assert got[1][key] == want[1][key], key
    assert got[1]["loss"] == pytest.approx(want[1]["loss"], rel=1e-5, abs=1e-7)
    assert got[1]["grad_norm"] == pytest.approx(want[1]["grad_norm"], rel=1e-4)
