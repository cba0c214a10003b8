"""Topology mapper: every rank gets exactly one loader shard, owners sit at tp=pp=cp=0, the hash is stable."""

from __future__ import annotations

import itertools
import os
import subprocess
import sys
from pathlib import Path

import pytest
from pydantic import ValidationError

from vlmrun.config.layout import RankCoords, RankLayout
from vlmrun.config.load import load_recipe
from vlmrun.config.parallel import ParallelConfig
from vlmrun.distributed.topology import plan_placement
from vlmrun.errors import InputError

ROOT = Path(__file__).resolve().parents[1]


def _sweep() -> list[tuple[int, int, int, int]]:
    """(dp, tp, pp, cp) with world sizes from 1 to 1024, odd sizes included, plus the extremes."""
    grid = itertools.product((1, 2, 3, 5, 8, 16, 32, 64, 128), (1, 2, 3, 4, 8), (1, 2, 4), (1, 2))
    layouts = {combo for combo in grid if combo[0] * combo[1] * combo[2] * combo[3] <= 1024}
    layouts |= {(1024, 1, 1, 1), (1, 1024, 1, 1), (1, 1, 1024, 1), (1, 1, 1, 1024), (7, 3, 5, 9), (16, 8, 4, 2)}
    return sorted(layouts)


SWEEP = _sweep()


def _layout(combo: tuple[int, int, int, int]) -> RankLayout:
    dp, tp, pp, cp = combo
    return ParallelConfig(dp=dp, tp=tp, pp=pp, cp=cp).layout


def _ids(combo: tuple[int, int, int, int]) -> str:
    return "dp{}-tp{}-pp{}-cp{}".format(*combo)


def _reference_coords(layout: RankLayout) -> list[RankCoords]:
    """Coordinates of ranks 0, 1, ... by counting in Megatron's order: tp fastest, then cp, dp, pp."""
    return [
        RankCoords(tp=tp, cp=cp, dp=dp, pp=pp)
        for pp, dp, cp, tp in itertools.product(range(layout.pp), range(layout.dp), range(layout.cp), range(layout.tp))
    ]


def test_sweep_spans_1_to_1024_ranks():
    sizes = {_layout(combo).world_size for combo in SWEEP}
    assert min(sizes) == 1 and max(sizes) == 1024 and len(SWEEP) > 200


@pytest.mark.parametrize("combo", SWEEP, ids=_ids)
def test_every_rank_gets_exactly_one_shard_from_an_owner_at_tp_pp_cp_zero(combo):
    layout = _layout(combo)
    plan = plan_placement(layout)

    assert len(plan.shards) == layout.dp
    assert [s.shard for s in plan.shards] == list(range(layout.dp))
    delivered = [rank for s in plan.shards for rank in s.delivery_ranks]
    assert sorted(delivered) == list(range(layout.world_size))  # disjoint and covering
    for s in plan.shards:
        assert s.num_shards == layout.dp
        assert len(s.delivery_ranks) == layout.tp * layout.pp * layout.cp
        assert list(s.delivery_ranks) == sorted(s.delivery_ranks)
        assert s.owner_rank in s.delivery_ranks
        assert layout.coords(s.owner_rank) == RankCoords(tp=0, cp=0, dp=s.shard, pp=0)
        assert plan.owner_of_shard(s.shard) == s.owner_rank
        assert {plan.shard_of_rank(rank) for rank in s.delivery_ranks} == {s.shard}
    assert [layout.coords(rank) for rank in range(layout.world_size)] == _reference_coords(layout)


def test_hash_is_pinned():
    # Changing these means every existing checkpoint refuses to resume: bump _PLAN_SCHEMA on purpose.
    assert plan_placement(ParallelConfig(dp=1).layout).placement_hash == "76435d888f6cc922"
    assert plan_placement(ParallelConfig(dp=2).layout).placement_hash == "5577b241e8413c71"
    assert plan_placement(ParallelConfig(dp=16, tp=8, pp=4, cp=2).layout).placement_hash == "c38b58a34da9b8b8"


def test_hash_is_the_same_in_another_process():
    code = (
        "from vlmrun.config.parallel import ParallelConfig; from vlmrun.distributed.topology import plan_placement;"
        "print(plan_placement(ParallelConfig(dp=4, tp=2, pp=3).layout).placement_hash)"
    )
    env = {**os.environ, "PYTHONHASHSEED": "12345"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, env=env)
    assert out.stdout.strip() == plan_placement(ParallelConfig(dp=4, tp=2, pp=3).layout).placement_hash


def test_hash_differs_between_layouts_even_of_the_same_world_size():
    hashes = {plan_placement(_layout(combo)).placement_hash for combo in SWEEP}
    assert len(hashes) == len(SWEEP)
    assert all(len(h) == 16 and int(h, 16) >= 0 for h in hashes)


def test_describe_names_the_layout_for_error_messages():
    assert plan_placement(ParallelConfig(dp=2).layout).describe() == "dp=2 tp=1 pp=1 cp=1 (2 ranks)"
    assert ParallelConfig(dp=1).layout.describe() == "dp=1 tp=1 pp=1 cp=1 (1 rank)"
    assert ParallelConfig(dp=4, tp=2, pp=2, cp=2).layout.describe() == "dp=4 tp=2 pp=2 cp=2 (32 ranks)"


def test_small_layout_by_hand():
    # dp=2 tp=2 pp=2: ranks 0,1 | 2,3 are replicas 0 | 1 on stage 0; 4,5 | 6,7 on stage 1.
    plan = plan_placement(ParallelConfig(dp=2, tp=2, pp=2).layout)
    assert [(s.owner_rank, s.delivery_ranks) for s in plan.shards] == [(0, (0, 1, 4, 5)), (2, (2, 3, 6, 7))]
    assert plan.layout.coords(7) == RankCoords(tp=1, cp=0, dp=1, pp=1)


@pytest.mark.parametrize("field", ["dp", "tp", "pp", "cp"])
@pytest.mark.parametrize("value", [0, -1, -8, 1.5, True, "2", None])
def test_invalid_size_raises_value_error_naming_the_field(field, value):
    sizes = {"dp": 2, field: value}
    with pytest.raises(ValidationError) as excinfo:
        ParallelConfig(**sizes)
    assert [e["loc"] for e in excinfo.value.errors()] == [(field,)]


@pytest.mark.parametrize("value", ["0", "true", "1.5"])
def test_invalid_size_in_a_recipe_names_the_recipe_field(value):
    with pytest.raises(InputError) as excinfo:
        load_recipe(ROOT / "recipes" / "tiny-clevr-cpu.yaml", [f"parallel.tp={value}"])
    assert excinfo.value.field == "parallel.tp"


def test_layout_is_keyword_only_and_frozen():
    with pytest.raises(TypeError):
        ParallelConfig(2)  # type: ignore[misc]
    layout = ParallelConfig(dp=2)
    with pytest.raises(ValidationError):
        layout.dp = 3  # type: ignore[misc]


def test_out_of_range_rank_or_shard_names_the_layout():
    plan = plan_placement(ParallelConfig(dp=2, tp=2).layout)
    for bad in (-1, 4):
        with pytest.raises(ValueError, match=r"dp=2 tp=2 pp=1 cp=1 \(4 ranks\)"):
            plan.shard_of_rank(bad)
    with pytest.raises(ValueError, match="shard 2 does not exist"):
        plan.owner_of_shard(2)


@pytest.fixture(scope="module")
def rank_generator():
    parallel_state = pytest.importorskip(
        "megatron.core.parallel_state", reason="megatron-core (gpu extra)", exc_type=ImportError
    )
    return parallel_state.RankGenerator


@pytest.mark.parametrize("combo", SWEEP, ids=_ids)
def test_matches_megatron_core_rank_groups(combo, rank_generator):
    layout = _layout(combo)
    plan = plan_placement(layout)
    generator = rank_generator(tp=layout.tp, ep=1, dp=layout.dp, pp=layout.pp, cp=layout.cp, order="tp-cp-ep-dp-pp")
    # Groups that vary tp, cp and pp with dp fixed are the replicas, in dp order.
    replicas = generator.get_ranks("tp-cp-pp")
    assert [tuple(sorted(group)) for group in replicas] == [s.delivery_ranks for s in plan.shards]
    # Position in a dp group is the dp rank, so shard_of_rank agrees with Megatron's data-parallel rank.
    for group in generator.get_ranks("dp"):
        assert [plan.shard_of_rank(rank) for rank in group] == list(range(layout.dp))
    for group in generator.get_ranks("tp"):
        assert [layout.coords(rank).tp for rank in group] == list(range(layout.tp))
    for group in generator.get_ranks("pp"):
        assert [layout.coords(rank).pp for rank in group] == list(range(layout.pp))
    for group in generator.get_ranks("cp"):
        assert [layout.coords(rank).cp for rank in group] == list(range(layout.cp))


@pytest.mark.parametrize("combo", [(4, 1, 1, 1), (4, 2, 2, 1), (2, 2, 1, 2), (8, 1, 2, 2), (6, 2, 1, 1)], ids=_ids)
@pytest.mark.parametrize("ep", [1, 2, 4])
def test_expert_coordinates_match_megatron_core_expert_groups(combo, ep, rank_generator):
    dp, tp, pp, cp = combo
    if (dp * cp) % ep:
        pytest.skip("ep must divide cp x dp")
    layout = RankLayout(dp=dp, tp=tp, pp=pp, cp=cp, ep=ep)
    # megatron-core's expert ranks (expert tensor parallel = tp): ep carved out of cp x dp, cp folded in
    experts = rank_generator(tp=tp, ep=ep, dp=dp * cp // ep, pp=pp, cp=1, order="tp-cp-ep-dp-pp")
    for group in experts.get_ranks("ep"):
        assert [layout.coords(rank).ep for rank in group] == list(range(ep))
    assert layout.world_size == dp * tp * pp * cp  # experts add no ranks


def test_a_layout_refuses_sizes_that_do_not_fit():
    for sizes, words in (
        ({"dp": 0}, "integers >= 1"),
        ({"dp": 4, "dp_shard": 3}, "dp_shard=3 must divide dp=4"),
        ({"dp": 2, "ep": 4}, "ep=4 must divide cp x dp = 2"),
    ):
        with pytest.raises(ValueError, match=words):
            RankLayout(**sizes)
