"""Cooking and encoding: the processor's own tokenization, labels on assistant tokens only, the
data.max_seq_len rule (a conversation is cut only where its image and an answer token stay; a prompt
is never cut; otherwise SampleTooLong names the sample, its tokens and the limit), prompts for
generation, malformed samples named by key."""

from __future__ import annotations

import pytest
import torch
from data_samples import FAMILIES, read_raw_samples

from vlmrun.config.families import family_spec
from vlmrun.data.batch import IGNORE_INDEX
from vlmrun.data.chat_encoding import ConversationEncoder, SampleTooLong
from vlmrun.data.cookers import MalformedSample, cook_conversation, decode_media, media_pixels
from vlmrun.data.loader import load_processor

END_OF_TURN = "<|im_end|>"


@pytest.fixture(scope="module")
def raw(clevr_set):
    return read_raw_samples(clevr_set, "train")


@pytest.fixture(scope="module", params=FAMILIES)
def encoder(request, tiny_dirs):
    family = request.param
    return ConversationEncoder(load_processor(tiny_dirs[family], family), family_spec(family), max_seq_len=256)


def test_tokens_and_pixels_equal_the_processor_on_the_whole_text(encoder, raw):
    for key in ("train-0000000", "train-0000001", "train-0000042"):
        conv = cook_conversation(raw[key])
        encoded = encoder.encode(conv)
        text = encoder.processor.apply_chat_template(conv.messages, tokenize=False)
        images = [media_pixels(conv, i) for i in range(len(conv.media))]
        whole = encoder.processor(text=[text], images=images, return_tensors="pt")
        assert torch.equal(encoded.input_ids, whole["input_ids"][0])
        for k in encoder.family.media_keys:
            assert torch.equal(encoded.media[k], whole[k])
        for k in encoder.family.token_keys:
            assert torch.equal(encoded.token_inputs[k], whole[k][0])


def test_labels_cover_the_answer_and_its_end_of_turn_token_only(encoder, raw):
    conv = cook_conversation(raw["train-0000003"])
    encoded = encoder.encode(conv)
    trained = encoded.labels != IGNORE_INDEX
    assert torch.equal(encoded.labels[trained], encoded.input_ids[trained])
    assert encoder.tokenizer.decode(encoded.input_ids[trained]) == conv.answer + END_OF_TURN
    # the labelled tokens are one contiguous run: the assistant turn, not its header or the newline after
    positions = trained.nonzero().flatten()
    assert positions[-1] - positions[0] + 1 == len(positions)
    assert encoder.tokenizer.decode(encoded.input_ids[positions[-1] + 1 :]).strip() == ""


def limited(encoder: ConversationEncoder, max_seq_len: int) -> ConversationEncoder:
    return ConversationEncoder(encoder.processor, encoder.family, max_seq_len=max_seq_len)


def first_label(encoded) -> int:
    return int((encoded.labels != IGNORE_INDEX).nonzero()[0])


def test_an_over_long_answer_is_cut_keeping_the_image_and_one_answer_token(encoder, raw):
    conv = cook_conversation(raw["train-0000004"])
    full = encoder.encode(conv)
    keep = first_label(full) + 1  # the prompt with its image, and the first answer token
    cut = limited(encoder, keep).encode(conv)
    assert cut.truncated and not full.truncated and cut.media_end == full.media_end <= keep
    assert cut.input_ids.numel() == keep and int((cut.labels != IGNORE_INDEX).sum()) == 1
    assert torch.equal(cut.input_ids, full.input_ids[:keep]) and torch.equal(cut.labels, full.labels[:keep])
    for k in encoder.family.media_keys:
        assert torch.equal(cut.media[k], full.media[k])
    batch = encoder.collate([full, cut])  # the batch holds both images, in sample order
    for k in encoder.family.media_keys:
        assert torch.equal(batch.media[k], torch.cat([full.media[k], cut.media[k]]))


@pytest.mark.parametrize("short_by", [0, 1, 5])
def test_a_cut_that_loses_the_answer_or_the_image_is_refused_naming_tokens_and_limit(encoder, raw, short_by):
    conv = cook_conversation(raw["train-0000004"])
    full = encoder.encode(conv)
    limit = first_label(full) - short_by  # 0: the whole prompt fits, but no answer token
    with pytest.raises(SampleTooLong) as err:
        limited(encoder, limit).encode(conv)
    message = str(err.value)
    assert message.startswith(f"train-0000004: {full.input_ids.numel()} tokens, more than data.max_seq_len={limit}")
    assert ("no answer token" if short_by == 0 else "its image would be cut") in message


def test_a_text_only_conversation_is_cut_after_its_first_answer_token(encoder, raw):
    conv = cook_conversation(raw["train-0000004"])
    conv.messages = [{**m, "content": [part for part in m["content"] if part["type"] == "text"]} for m in conv.messages]
    conv.media = []
    full = encoder.encode(conv)
    assert full.media == {} and full.media_end == 0
    cut = limited(encoder, first_label(full) + 1).encode(conv)
    assert cut.truncated and int((cut.labels != IGNORE_INDEX).sum()) == 1


def test_a_grpo_answer_has_the_new_tokens_of_room_beyond_the_prompt(encoder, raw):
    conv = cook_conversation(raw["train-0000004"])
    full = encoder.encode(conv)
    prompt, answer = first_label(full), full.input_ids.numel() - first_label(full)
    roomy = ConversationEncoder(encoder.processor, encoder.family, max_seq_len=prompt, answer_room=answer)
    assert not roomy.encode(conv).truncated and roomy.encode_prompt(conv).input_ids.numel() == prompt
    tight = ConversationEncoder(encoder.processor, encoder.family, max_seq_len=prompt - 2, answer_room=1)
    with pytest.raises(SampleTooLong, match=f"more than data.max_seq_len={prompt - 2} \\+ grpo.max_new_tokens=1;"):
        tight.encode(conv)


def test_a_prompt_is_never_cut(encoder, raw):
    conv = cook_conversation(raw["train-0000004"])
    n = encoder.encode_prompt(conv).input_ids.numel()
    assert limited(encoder, n).encode_prompt(conv).input_ids.numel() == n
    with pytest.raises(SampleTooLong) as err:
        limited(encoder, n - 1).encode_prompt(conv)
    assert str(err.value) == (
        f"train-0000004: its prompt has {n} tokens (its image included), more than data.max_seq_len={n - 1}"
    )


def test_batch_is_right_padded_and_the_model_accepts_it(encoder, raw, tiny_dirs):
    from transformers import AutoModelForImageTextToText

    encoded = [encoder.encode(cook_conversation(raw[f"train-000000{i}"])) for i in range(3)]
    batch = encoder.collate(encoded)
    for row, e in enumerate(encoded):
        n = e.input_ids.numel()
        assert torch.equal(batch.input_ids[row, :n], e.input_ids) and batch.attention_mask[row, n:].sum() == 0
        assert (batch.input_ids[row, n:] == encoder.pad_token_id).all()
    family = encoder.family.name
    model = AutoModelForImageTextToText.from_pretrained(tiny_dirs[family])
    with torch.no_grad():
        out = model(**batch.model_inputs(), use_cache=False)
    assert out.logits.shape[:2] == batch.input_ids.shape


def test_prompt_is_the_text_before_the_answer_left_padded(encoder, raw):
    convs = [cook_conversation(raw[k]) for k in ("train-0000005", "train-0000006")]
    prompts = [encoder.encode_prompt(c) for c in convs]
    for conv, prompt in zip(convs, prompts, strict=True):
        encoded = encoder.encode(conv)
        first_label = int((encoded.labels != IGNORE_INDEX).nonzero()[0])
        assert torch.equal(prompt.input_ids, encoded.input_ids[:first_label])
        assert prompt.answer == conv.answer
    batch = encoder.collate_prompts(prompts)
    width = batch.input_ids.shape[1]
    for row, p in enumerate(prompts):
        n = p.input_ids.numel()
        assert torch.equal(batch.input_ids[row, width - n :], p.input_ids)
        assert batch.attention_mask[row, : width - n].sum() == 0
    assert batch.answers == [c.answer for c in convs]


@pytest.mark.parametrize(
    ("damage", "message"),
    [
        (lambda s: {**s, "jpg": s["jpg"][: len(s["jpg"]) // 2]}, "cannot decode 'jpg'"),
        (lambda s: {**s, "jpg": b"definitely not an image" * 4}, "cannot decode 'jpg'"),
        (lambda s: {**s, "json": b'{"media": []}'}, "no 'messages' list"),
        (lambda s: {k: v for k, v in s.items() if k != "jpg"}, "media ref 'jpg' names no member"),
        (lambda s: {k: v for k, v in s.items() if k != "json"}, "no .json member"),
        (lambda s: {**s, "json": b"{not json"}, "not valid JSON"),
    ],
    ids=["truncated-image", "undecodable-image", "no-messages", "missing-member", "no-json", "bad-json"],
)
def test_malformed_sample_is_named_by_key(encoder, raw, damage, message):
    # Structure fails when cooking, media bytes when the encoder decodes them: both name the key.
    with pytest.raises(MalformedSample, match=message) as err:
        encoder.encode(cook_conversation(damage(raw["train-0000007"])))
    assert str(err.value).startswith("train-0000007:")


def test_cooked_conversation_is_model_neutral(raw):
    conv = cook_conversation(raw["train-0000008"])
    assert [m["role"] for m in conv.messages] == ["user", "assistant"]
    assert conv.messages[0]["content"][0] == {"type": "image", "media": 0}
    (item,) = conv.media
    assert item.modality == "image" and item.data == raw["train-0000008"]["jpg"]  # still encoded
    assert item.metadata == {"modality": "image", "width": 64, "height": 64, "ref": "jpg"}
    pixels = media_pixels(conv, 0)
    assert pixels.dtype == torch.uint8 and pixels.shape == (3, 64, 64)
    assert torch.equal(decode_media(conv).media[0].data, pixels)  # decoded in place, same pixels
