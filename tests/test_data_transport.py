"""Packed transport: micro-batches survive the trip bit for bit, each in memory of its own, and a
worker reuses a slot only after the main process gave it back."""

from __future__ import annotations

import pickle
from types import SimpleNamespace

import pytest
import torch
from data_samples import read_raw_samples

from vlmrun.config.families import family_spec
from vlmrun.data import transport
from vlmrun.data.chat_encoding import ConversationEncoder
from vlmrun.data.cookers import cook_conversation
from vlmrun.data.loader import load_processor
from vlmrun.data.transport import SlotPool, collate_packed, unpack


@pytest.fixture(scope="module")
def groups(clevr_set, tiny_dirs):
    encoder = ConversationEncoder(load_processor(tiny_dirs["qwen2_5_vl"], "qwen2_5_vl"), family_spec("qwen2_5_vl"), 256)
    raw = list(read_raw_samples(clevr_set, "train").values())[:8]
    encoded = [encoder.encode(cook_conversation(r)) for r in raw]
    return encoder, [encoded[i : i + 2] for i in range(0, 8, 2)]


def as_worker(monkeypatch, worker_id=0):
    monkeypatch.setattr(torch.utils.data, "get_worker_info", lambda: SimpleNamespace(id=worker_id, num_workers=1))


def assert_same(batch, expected):
    assert batch.sample_ids == expected.sample_ids
    for name in ("input_ids", "attention_mask", "labels"):
        assert torch.equal(getattr(batch, name), getattr(expected, name))
    assert batch.media.keys() == expected.media.keys() and batch.token_inputs.keys() == expected.token_inputs.keys()
    assert all(torch.equal(batch.media[k], expected.media[k]) for k in expected.media)
    assert all(torch.equal(batch.token_inputs[k], expected.token_inputs[k]) for k in expected.token_inputs)


@pytest.mark.parametrize("in_worker", [False, True])
def test_round_trip_is_exact(groups, monkeypatch, in_worker):
    encoder, micro = groups
    expected = [encoder.collate(g) for g in micro]
    pool = SlotPool(num_workers=1)
    if in_worker:
        as_worker(monkeypatch)
    packed = collate_packed(encoder, micro, pool)
    monkeypatch.undo()
    assert (packed.slot is not None) == in_worker and len(packed.blocks) == (1 if in_worker else 4)
    for batch, want in zip(pool.unpack(packed), expected, strict=True):
        assert_same(batch, want)


def test_each_micro_batch_pickles_alone(groups, monkeypatch):
    encoder, micro = groups
    as_worker(monkeypatch)
    packed = collate_packed(encoder, micro, SlotPool(num_workers=1))
    monkeypatch.undo()
    batch = unpack(packed)[0]
    own = sum(t.numel() * t.element_size() for t in batch.model_inputs().values())
    assert len(pickle.dumps(batch)) < 1.5 * own  # not the whole group's block


def test_a_slot_is_reused_only_after_release(groups, monkeypatch):
    encoder, micro = groups
    pool = SlotPool(num_workers=1)
    as_worker(monkeypatch)
    sent = [collate_packed(encoder, micro, pool) for _ in range(transport._SLOTS_PER_WORKER)]
    assert sorted(p.slot for p in sent) == list(range(transport._SLOTS_PER_WORKER))
    overflow = collate_packed(encoder, micro, pool)  # every slot still held by the main process
    assert overflow.slot is None
    monkeypatch.undo()
    pool.unpack(sent[1])
    as_worker(monkeypatch)
    assert collate_packed(encoder, micro, pool).slot == sent[1].slot
