"""Loader identity fingerprint: every change that would silently alter the sample stream is refused,
naming the field as `path: old -> new`; the Energon state survives torch.load(weights_only=True)."""

from __future__ import annotations

import io
import shutil
from types import MappingProxyType

import pytest
import torch
from data_samples import make_recipe

from vlmrun.data import components as families
from vlmrun.data.fingerprint import LoaderStateRefused, check_same_identity, loader_fingerprint
from vlmrun.errors import InputError

TEMPLATE = "{{ messages }}"


def fingerprint(
    recipe,
    tiny_dirs,
    *,
    processor_dir=None,
    template=TEMPLATE,
    shard=1,
    num_shards=2,
    placement_hash="abc",
    split="train",
):
    return loader_fingerprint(
        recipe,
        processor_dir=processor_dir or tiny_dirs[recipe.family],
        chat_template=template,
        shard=shard,
        num_shards=num_shards,
        placement_hash=placement_hash,
        split=split,
    )


def refused_fields(old: dict, new: dict) -> str:
    with pytest.raises(LoaderStateRefused) as err:
        check_same_identity(old, new, shard=new["topology.shard"])
    assert isinstance(err.value, InputError) and err.value.exit_code == 2
    return str(err.value)


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"data": {"num_workers": 2}}, "data.num_workers: 0 -> 2"),
        ({"data": {"shuffle_buffer": 32}}, "data.shuffle_buffer: 16 -> 32"),
        ({"data": {"shuffle_buffer": 0}}, "data.shuffle: true -> false"),
        ({"data": {"max_samples_per_sequence": 4}}, "data.max_samples_per_sequence: 8 -> 4"),
        ({"data": {"virtual_epoch_length": 40}}, "data.virtual_epoch_length: 0 -> 40"),
        ({"data": {"max_seq_len": 512}}, "data.max_seq_len: 256 -> 512"),
        ({"data": {"transfer_samples": 16}}, "loader.transfer_group: 4 -> 8"),
        ({"train": {"seed": 7}}, "train.seed: 1234 -> 7"),
        ({"train": {"micro_batch_size": 4, "global_batch_size": 4}}, "train.micro_batch_size: 2 -> 4"),
        ({"family": "nemotron_omni"}, "data.family: qwen2_5_vl -> nemotron_omni"),
    ],
)
def test_recipe_changes_are_refused(clevr_set, tiny_dirs, change, field):
    base = fingerprint(make_recipe(clevr_set), tiny_dirs)
    changed = make_recipe(
        clevr_set, family=change.get("family", "qwen2_5_vl"), train=change.get("train"), **change.get("data", {})
    )
    message = refused_fields(base, fingerprint(changed, tiny_dirs))
    assert field in message


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"shard": 0}, "topology.shard: 1 -> 0"),
        ({"num_shards": 4}, "topology.num_shards: 2 -> 4"),
        ({"placement_hash": "def"}, "topology.placement_hash: abc -> def"),
        ({"split": "val"}, "data.split: train -> val"),
        ({"template": TEMPLATE + " "}, "processor.chat_template:"),
    ],
)
def test_topology_split_and_template_changes_are_refused(clevr_set, tiny_dirs, kwargs, field):
    recipe = make_recipe(clevr_set)
    message = refused_fields(fingerprint(recipe, tiny_dirs), fingerprint(recipe, tiny_dirs, **kwargs))
    assert field in message


def test_dataset_and_processor_changes_are_refused(clevr_set, tiny_dirs, tmp_path):
    recipe = make_recipe(clevr_set)
    base = fingerprint(recipe, tiny_dirs)
    moved = shutil.copytree(clevr_set, tmp_path / "moved")
    assert "data.path:" in refused_fields(base, fingerprint(make_recipe(moved), tiny_dirs))
    processor = shutil.copytree(tiny_dirs["qwen2_5_vl"], tmp_path / "processor")
    config = processor / "processor_config.json"
    config.write_text(config.read_text().replace('"patch_size": 14', '"patch_size": 16'))
    assert "processor.config:" in refused_fields(base, fingerprint(recipe, tiny_dirs, processor_dir=processor))


def test_component_and_energon_versions_are_refused(clevr_set, tiny_dirs, monkeypatch):
    import megatron.energon

    recipe = make_recipe(clevr_set)
    base = fingerprint(recipe, tiny_dirs)
    spec = families.COOKERS["conversation"]
    bumped = type(spec)(name=spec.name, version=spec.version + 1, families=spec.families, subflavors=spec.subflavors)
    monkeypatch.setattr(families, "COOKERS", MappingProxyType({"conversation": bumped}))
    message = refused_fields(base, fingerprint(recipe, tiny_dirs))
    assert 'data.cookers: ["conversation@1"] -> ["conversation@2"]' in message
    monkeypatch.undo()
    monkeypatch.setattr(megatron.energon, "__version__", "99.0")
    assert "versions.energon: 7" in refused_fields(base, fingerprint(recipe, tiny_dirs))


def test_every_changed_field_is_listed(clevr_set, tiny_dirs):
    old = fingerprint(make_recipe(clevr_set), tiny_dirs)
    new = fingerprint(make_recipe(clevr_set, num_workers=1, train={"seed": 1}), tiny_dirs, shard=0)
    message = refused_fields(old, new)
    for field in ("data.num_workers: 0 -> 1", "train.seed: 1234 -> 1", "topology.shard: 1 -> 0"):
        assert field in message


def test_same_settings_pass(clevr_set, tiny_dirs):
    recipe = make_recipe(clevr_set)
    check_same_identity(fingerprint(recipe, tiny_dirs), fingerprint(recipe, tiny_dirs), shard=1)


def test_energon_state_round_trips_weights_only():
    from megatron.energon.savable_loader import SavableDataLoaderState
    from megatron.energon.state import FlexState

    from vlmrun.data.loader_state import LoaderStateError, from_plain, to_plain

    rng = __import__("numpy").random.RandomState(3).get_state()
    state = SavableDataLoaderState(
        worker_states=[FlexState(rng=b"\x01\x02", numpy=rng, t=torch.arange(3), n=(1, "a"))],
        next_worker_id=1,
        micro_batch_size=2,
    )
    buffer = io.BytesIO()
    torch.save(to_plain(state), buffer)
    buffer.seek(0)
    back = from_plain(torch.load(buffer, weights_only=True))
    assert isinstance(back, SavableDataLoaderState) and back.next_worker_id == 1
    inner = back.worker_states[0]
    assert isinstance(inner, FlexState) and inner["rng"] == b"\x01\x02" and inner["n"] == (1, "a")
    assert inner["numpy"][0] == rng[0] and (inner["numpy"][1] == rng[1]).all()
    with pytest.raises(LoaderStateError, match="only hold Energon types"):
        from_plain({"__type__": "os:system", "fields": {}})
