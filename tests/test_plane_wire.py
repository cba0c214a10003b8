"""The multimodal wire and the local plane: random ragged batches come back exactly as they were put.

`ragged_batches` (hypothesis) and `check_round_trip` are shared with the TransferQueue tests
(tests/test_plane_transfer_queue.py), which run the same property through the other adapters.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from vlmrun.algorithms.grpo.fields import GrpoStage, partition_spec
from vlmrun.plane.fields import FIELDS, Alignment, field_spec, media_fields
from vlmrun.plane.interface import DataPlane, DataPlaneError, Get, Put
from vlmrun.plane.local import LocalDataPlane
from vlmrun.plane.wire import WireError, decode_column, encode_column, pack_media, rows_of, to_jagged
from vlmrun.plane.wire.codec import empty_row, row_numel

#: The same examples on every run (CI), no example database in the work tree, no per-example deadline.
HYPOTHESIS = dict(
    derandomize=True,
    database=None,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
GRID = {"qwen2_5_vl": ("image_grid_thw", 3), "nemotron_omni": ("image_grid_hw", 2)}


@dataclass
class RaggedBatch:
    """One rollout's worth of samples: the first write, a later stage's column, a shard and a field subset."""

    family: str
    pixel_dtype: torch.dtype
    ids: list[str]
    columns: dict[str, list]
    tags: list[dict]
    prev_logprobs: list[torch.Tensor]
    shard: list[str]
    fields: list[str]


@st.composite
def ragged_batches(draw, max_samples: int = 4) -> RaggedBatch:
    """Mixed image counts (text-only rows too), bf16 or fp32 pixels, differing trailing shapes."""
    family = draw(st.sampled_from(sorted(GRID)))
    pixel_dtype = draw(st.sampled_from([torch.float32, torch.bfloat16]))
    n = draw(st.integers(1, max_samples))
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    grid_key, grid_width = GRID[family]
    columns: dict[str, list] = {k: [] for k in ("prompt_ids", "response_ids", "response_mask", "generation_logprobs")}
    columns |= {"rewards": [], "pixel_values": [], grid_key: []}
    if family == "qwen2_5_vl":
        columns["mm_token_type_ids"] = []
    prev = []
    for _ in range(n):
        n_prompt, n_resp = draw(st.integers(1, 6)), draw(st.integers(0, 4))
        columns["prompt_ids"].append(torch.randint(0, 1000, (n_prompt,), generator=gen))
        if "mm_token_type_ids" in columns:
            columns["mm_token_type_ids"].append(torch.randint(0, 2, (n_prompt,), generator=gen))
        columns["response_ids"].append(torch.randint(0, 1000, (n_resp,), generator=gen))
        columns["response_mask"].append(torch.rand(n_resp, generator=gen) > 0.3)
        columns["generation_logprobs"].append(-torch.rand(n_resp, generator=gen))
        columns["rewards"].append(torch.randn((), generator=gen))
        prev.append(-torch.rand(n_resp, generator=gen))
        images = draw(st.integers(0, 3))
        shapes = [
            (draw(st.integers(0, 5)), *draw(st.sampled_from([(4,), (6,), (2, 3)])))  # rows x differing trailing dims
            for _ in range(images)
        ]
        src = draw(st.sampled_from([torch.float32, torch.bfloat16]))
        columns["pixel_values"].append([torch.randn(s, generator=gen).to(src) for s in shapes])
        grid = torch.randint(1, 9, (images, grid_width), generator=gen)
        columns[grid_key].append(draw(st.sampled_from([[grid], list(grid.split(1))])) if images else [])
    ids = [f"s{i}-{uuid.uuid4().hex[:6]}" for i in range(n)]
    shard = draw(st.lists(st.sampled_from(ids), min_size=1, max_size=n, unique=True))
    fields = draw(st.lists(st.sampled_from(sorted(columns)), min_size=1, unique=True))
    tags = [{"group": i // 2, "prompt": f"p{i}"} for i in range(n)]
    return RaggedBatch(family, pixel_dtype, ids, columns, tags, prev, shard, fields)


def expected(name: str, value, pixel_dtype: torch.dtype):
    if name == "pixel_values":
        return [s.to(pixel_dtype) for s in value]
    return value


def assert_same(got, want) -> None:
    """Bitwise equal, same dtype and shape; media as lists of segments."""
    if isinstance(want, list):
        assert isinstance(got, list) and len(got) == len(want)
        for g, w in zip(got, want, strict=True):
            assert_same(g, w)
        return
    assert isinstance(got, torch.Tensor) and got.dtype == want.dtype and got.shape == want.shape
    assert torch.equal(got, want)


def check_round_trip(plane: DataPlane, batch: RaggedBatch) -> None:
    """First write, a dp-shard and field-subset read, a later stage's column, errors, clear."""
    part = f"step-{uuid.uuid4().hex[:8]}"
    plane.register(part, partition_spec(batch.family, kl=True, num_samples=len(batch.ids)))
    plane.put(part, batch.ids, batch.columns, tags=batch.tags)
    assert plane.list_sample_ids(part) == batch.ids
    got = plane.get(part, batch.shard, batch.fields)
    assert got.sample_ids == batch.shard
    for name in batch.fields:
        for sid, value in zip(batch.shard, got[name], strict=True):
            assert_same(value, expected(name, batch.columns[name][batch.ids.index(sid)], batch.pixel_dtype))
    assert got.tags == [batch.tags[batch.ids.index(sid)] for sid in batch.shard]
    with pytest.raises(DataPlaneError, match="not written"):
        plane.get(part, batch.shard, ["prev_logprobs"])
    plane.put(part, batch.ids, {"prev_logprobs": batch.prev_logprobs})  # a later stage, the same ids
    train = plane.get(part, batch.shard, plane.spec(part).stage_fields(GrpoStage.LOGPROB) + ("prev_logprobs",))
    for sid, value in zip(batch.shard, train["prev_logprobs"], strict=True):
        assert_same(value, batch.prev_logprobs[batch.ids.index(sid)])
    for name in media_fields(batch.family):
        assert_same(
            train[name],
            [expected(name, batch.columns[name][batch.ids.index(s)], batch.pixel_dtype) for s in batch.shard],
        )
    plane.clear(part)
    assert part not in plane.partitions()


@settings(max_examples=60, **HYPOTHESIS)
@given(batch=ragged_batches())
def test_local_plane_round_trips_ragged_batches_exactly(batch):
    check_round_trip(LocalDataPlane(pixel_dtype=batch.pixel_dtype), batch)


@settings(max_examples=60, **HYPOTHESIS)
@given(batch=ragged_batches())
def test_wire_round_trips_each_field_through_one_jagged_tensor(batch):
    for name, values in batch.columns.items():
        pieces, tags = encode_column(field_spec(name), values, pixel_dtype=batch.pixel_dtype)
        full = [p for p, t in zip(pieces, tags, strict=True) if row_numel(t)]  # rows of length 0 stay home
        jagged = to_jagged(full) if full else None
        assert jagged is None or (jagged.is_nested and jagged.layout is torch.jagged)  # what crosses a backend
        back = iter(rows_of(jagged, len(full), name) if full else [])
        rows = [next(back) if row_numel(t) else empty_row(t) for t in tags]
        decoded = decode_column(field_spec(name), rows, tags)
        assert_same(decoded, [expected(name, v, batch.pixel_dtype) for v in values])


def test_media_crosses_flat_with_its_shapes_in_the_tags():
    segments = [torch.randn(4, 6), torch.randn(2, 2, 3)]
    pieces, tags = encode_column(field_spec("pixel_values"), [segments, []], pixel_dtype=torch.bfloat16)
    assert [[p.shape for p in s] for s in pieces] == [[(24,), (12,)], []] and pieces[0][0].dtype == torch.bfloat16
    rows = [to_jagged(pieces[:1]).unbind()[0], empty_row(tags[1])]
    assert rows[0].shape == (36,) and rows[1].dtype == torch.bfloat16
    assert tags == [{"dtype": "bfloat16", "segments": [[4, 6], [2, 2, 3]]}, {"dtype": "bfloat16", "segments": []}]
    spec = field_spec("pixel_values")
    with pytest.raises(WireError, match="without its segment shapes"):
        decode_column(spec, rows, [{"dtype": "bfloat16"}, tags[1]])
    with pytest.raises(WireError, match="its tag says 30 elements"):
        decode_column(spec, rows, [{"dtype": "bfloat16", "segments": [[5, 6]]}, tags[1]])


@pytest.mark.parametrize(
    ("name", "values", "match"),
    [
        ("pixel_values", [torch.randn(4, 6)], "list of segments"),
        ("pixel_values", [[torch.randint(0, 3, (2, 2))]], "floating point"),
        ("pixel_values", [[{"rows": 1}]], "carries torch tensors"),
        ("pixel_values", [[torch.randn(3).numpy()]], "carries torch tensors"),
        ("image_grid_thw", [[torch.ones(1, 3, dtype=torch.int32)]], "registry says int64"),
        ("prompt_ids", [[1, 2, 3]], "carries torch tensors"),
        ("prompt_ids", [torch.ones(2, 3, dtype=torch.long)], "1-D"),
        ("rewards", [torch.ones(1)], "expected 0 dimensions"),
        ("rewards", torch.ones(3), "as a list"),
        ("generation_logprobs", [torch.nested.as_nested_tensor([torch.ones(2)], layout=torch.jagged)], "plain"),
        ("pixel_values", [[torch.randn(2, 2)], [torch.randn(2, 2).bfloat16()]], "one dtype"),
    ],
)
def test_the_wire_refuses_what_it_cannot_carry(name, values, match):
    with pytest.raises(WireError, match=match):
        encode_column(field_spec(name), values)


def test_pack_media_concatenates_segments_in_sample_order():
    a, b, c = torch.randn(2, 3), torch.randn(1, 3), torch.randn(4, 3)
    assert torch.equal(pack_media([[a, b], [], [c]]), torch.cat([a, b, c]))
    assert pack_media([[], []]) is None


def test_rows_of_normalizes_what_backends_return():
    jagged = to_jagged([torch.arange(3), [torch.arange(1), torch.arange(2)]])
    assert [r.tolist() for r in rows_of(jagged, 2)] == [[0, 1, 2], [0, 0, 1]]
    assert [r.tolist() for r in rows_of(torch.tensor([5, 6]), 2)] == [[5], [6]]  # (N,) from a dense 1-D field
    assert [r.tolist() for r in rows_of(torch.ones(2, 2, dtype=torch.long), 2)] == [[1, 1], [1, 1]]
    with pytest.raises(WireError, match="3 rows for 2 samples"):
        rows_of([torch.ones(1)] * 3, 2)
    with pytest.raises(WireError, match="not tensors"):
        rows_of(["a", "b"], 2)


def _grpo_plane(n: int = 4) -> tuple[LocalDataPlane, str, list[str]]:
    plane = LocalDataPlane()
    plane.register("p", partition_spec("qwen2_5_vl", kl=True, num_samples=n))
    ids = ["a", "b"]
    plane.put(
        "p",
        ids,
        {
            "prompt_ids": [torch.arange(3), torch.arange(2)],
            "response_ids": [torch.arange(2), torch.arange(1)],
            "pixel_values": [[torch.randn(4, 3)], []],
            "image_grid_thw": [[torch.tensor([[1, 2, 2]])], []],
        },
    )
    return plane, "p", ids


def test_plane_errors_say_what_is_wrong():
    plane, part, ids = _grpo_plane()
    cases = [
        (lambda: plane.get(part, ids, "all"), "explicit, non-empty list"),
        (lambda: plane.get(part, ids, ["all"]), "unknown field"),
        (lambda: plane.get(part, ids, None), "explicit, non-empty list"),
        (lambda: plane.get(part, ids, ["batch_input_ids"]), "not in the partition"),
        (lambda: plane.get(part, ids, ["ref_logprobs"]), "'ref_logprobs' was not written"),
        (lambda: plane.get(part, ["a", "zz"], ["prompt_ids"]), r"no sample\(s\) \['zz'\]"),
        (lambda: plane.get("nope", ids, ["prompt_ids"]), "no partition 'nope'"),
        (lambda: plane.put(part, ids, {"prompt_ids": [torch.arange(3), torch.arange(2)]}), "already written"),
        (lambda: plane.put(part, ["a", "c"], {"rewards": [torch.tensor(1.0)] * 2}), "not both"),
        (lambda: plane.put(part, ["c", "d", "e"], {"rewards": [torch.tensor(1.0)] * 3}), "exceed its 4"),
        (lambda: plane.put(part, ids, {"prev_logprobs": [torch.randn(2), torch.randn(2)]}), "differ in length"),
        (lambda: plane.put(part, ids, {"rewards": [torch.tensor(1.0)]}), "1 values for 2 samples"),
        (lambda: plane.put(part, ["c", "c"], {"rewards": [torch.tensor(1.0)] * 2}), "repeat"),
        (lambda: plane.put(part, ["c"], {"rewards": [torch.tensor(1.0)]}, tags=[{"_vlmrun": 1}]), "string keys"),
        (lambda: plane.register(part, partition_spec("qwen2_5_vl", kl=True, num_samples=4)), "already registered"),
    ]
    for call, match in cases:
        with pytest.raises(DataPlaneError, match=match):
            call()
    assert plane.list_sample_ids(part) == ids  # the refused calls changed nothing


def test_a_later_stage_adds_columns_and_tags_under_the_same_ids():
    plane, part, ids = _grpo_plane()
    plane.put(part, ids, {"rewards": [torch.tensor(0.5), torch.tensor(-1.0)]}, tags=[{"reward_model": "exact"}] * 2)
    plane.put(part, ["b"], {"advantages": [torch.tensor(2.0)]})
    got = plane.get(part, ["b"], ["advantages", "rewards", "response_ids"])
    assert got.stack("rewards").tolist() == [-1.0] and got["advantages"][0].shape == ()
    assert got.tags == [{"reward_model": "exact"}]
    assert all(FIELDS[f].alignment is not Alignment.MEDIA for f in got.columns)


def test_state_dict_is_empty_at_a_step_boundary_and_restores_open_partitions():
    plane, part, ids = _grpo_plane()
    state = plane.state_dict()
    restored = LocalDataPlane()
    restored.load_state_dict(state)
    assert restored.list_sample_ids(part) == ids
    assert_same(
        restored.get(part, ids, ["pixel_values"])["pixel_values"],
        plane.get(part, ids, ["pixel_values"])["pixel_values"],
    )
    plane.clear(part)
    assert plane.state_dict() == {}
    with pytest.raises(DataPlaneError, match="no partition"):
        plane.list_sample_ids(part)
    plane.clear(part)  # clearing twice is fine


def check_put_many_and_get_many(plane: DataPlane, tag: str) -> None:
    """Several requests, two partitions, one call each way; a put_many with one bad request writes nothing.
    Shared with tests/test_plane_transfer_queue.py."""
    a, b = f"many-{tag}-a", f"many-{tag}-b"
    for p in (a, b):
        plane.register(p, partition_spec("qwen2_5_vl", kl=True, num_samples=3))
    try:
        prompts = {
            "prompt_ids": [torch.arange(3), torch.arange(5)],
            "pixel_values": [[torch.randn(4, 6)], []],
            "image_grid_thw": [[torch.tensor([[1, 2, 2]])], []],
        }
        responses = {"response_ids": [torch.arange(2)], "rewards": [torch.tensor(1.0)]}
        refused = [
            ([Put(a, ["p", "q"], prompts), Put(a, ["r", "s"], {"rewards": [torch.tensor(0.0)] * 2})], "exceed its 3"),
            ([Put(a, ["p", "q"], prompts), Put(a, ["q"], {"rewards": [torch.tensor(0.0)]})], "once"),
            ([Put(a, ["p", "q"], prompts), Put(b, ["x"], {"logits": [torch.zeros(1)]})], "unknown field"),
            ([Put(b, ["_vlmrun:spec"], {"rewards": [torch.tensor(0.0)]})], "may not start with"),
        ]
        for requests, match in refused:
            with pytest.raises(DataPlaneError, match=match):
                plane.put_many(requests)
        assert plane.list_sample_ids(a) == [] and plane.list_sample_ids(b) == []  # nothing written
        plane.put_many([Put(a, ["p", "q"], prompts), Put(b, ["p#0"], responses), Put(a, ["p#0"], responses)])
        got = plane.get_many(
            [
                Get(b, ["p#0"], ["rewards"]),
                Get(a, ["q", "p"], ["prompt_ids", "pixel_values"]),
                Get(a, ["p#0"], ["response_ids"]),
            ]
        )
        assert got[0].stack("rewards").tolist() == [1.0]
        assert got[1].sample_ids == ["q", "p"]
        assert_same(got[1]["prompt_ids"], [torch.arange(5), torch.arange(3)])
        assert_same(got[1]["pixel_values"], [[], prompts["pixel_values"][0]])
        assert_same(got[2]["response_ids"], [torch.arange(2)])
        assert sorted(plane.list_sample_ids(a)) == ["p", "p#0", "q"]
    finally:
        plane.clear(a)
        plane.clear(b)
    assert a not in plane.partitions() and b not in plane.partitions()


def test_put_many_checks_every_request_before_it_writes_and_get_many_keeps_their_order():
    check_put_many_and_get_many(LocalDataPlane(), "local")
