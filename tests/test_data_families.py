"""Model-family registry: supported pairings pass, unsupported ones fail at validation naming the field
and the families that are supported; the registry and the implementations agree."""

from __future__ import annotations

from types import MappingProxyType

import pytest
from data_samples import FAMILIES, make_recipe

from vlmrun.config.families import family_spec
from vlmrun.data import components as families
from vlmrun.data.components import ComponentSpec, check_components
from vlmrun.errors import InputError


@pytest.mark.parametrize("family", FAMILIES)
def test_default_components_support_every_family(tmp_path, family):
    check_components(make_recipe(tmp_path, family=family))


def test_unsupported_pairing_lists_supported_families(tmp_path, monkeypatch):
    only_qwen = ComponentSpec(name="qwen_only", version=1, families=("qwen2_5_vl",))
    monkeypatch.setattr(families, "TASK_ENCODERS", MappingProxyType({"qwen_only": only_qwen}))
    check_components(make_recipe(tmp_path, family="qwen2_5_vl", task_encoder="qwen_only"))
    with pytest.raises(InputError) as err:
        check_components(make_recipe(tmp_path, family="nemotron_omni", task_encoder="qwen_only"))
    assert err.value.field == "data.task_encoder"
    assert "nemotron_omni" in str(err.value) and "supports: qwen2_5_vl" in str(err.value)


def test_unsupported_cooker_pairing_names_the_cooker_field(tmp_path, monkeypatch):
    only_nemotron = ComponentSpec(name="omni_only", version=1, families=("nemotron_omni",))
    monkeypatch.setattr(families, "COOKERS", MappingProxyType({"omni_only": only_nemotron}))
    with pytest.raises(InputError) as err:
        check_components(make_recipe(tmp_path, family="qwen2_5_vl", cookers=["omni_only"]))
    assert err.value.field == "data.cookers" and "supports: nemotron_omni" in str(err.value)


def test_unknown_component_lists_known_names(tmp_path):
    with pytest.raises(InputError) as err:
        check_components(make_recipe(tmp_path, cookers=["conversation", "nope"]))
    assert err.value.field == "data.cookers" and "known: conversation" in str(err.value)
    with pytest.raises(InputError) as err:
        check_components(make_recipe(tmp_path, task_encoder="nope"))
    assert err.value.field == "data.task_encoder" and "known: chat_sft" in str(err.value)


def test_registry_matches_implementations():
    from vlmrun.data.cookers import COOK_FUNCTIONS
    from vlmrun.data.task_encoder import _ENCODERS

    assert set(COOK_FUNCTIONS) == set(families.COOKERS)
    assert set(_ENCODERS) == set(families.TASK_ENCODERS)
    assert all(getattr(fn, "__stateless__", False) for fn in COOK_FUNCTIONS.values())


def test_the_recipe_type_lists_the_registry_and_a_bad_family_names_every_one(tmp_path):
    import typing

    from vlmrun.config.families import FAMILIES as REGISTRY
    from vlmrun.config.families import Family

    assert typing.get_args(Family) == tuple(REGISTRY)
    with pytest.raises(InputError) as err:
        make_recipe(tmp_path, family="llava")
    assert err.value.field == "model.family"
    assert all(f"'{family}'" in str(err.value) for family in REGISTRY), str(err.value)


def test_family_spec_names_the_processor_of_the_tiny_model(tiny_dirs):
    from transformers import AutoProcessor

    for family, path in tiny_dirs.items():
        assert type(AutoProcessor.from_pretrained(path)).__name__ == family_spec(family).processor_class


def test_registry_import_stays_light():
    import subprocess
    import sys

    code = (
        "import sys, vlmrun.data.components, vlmrun.config.families; "
        "print('torch' in sys.modules, 'megatron.energon' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["False", "False"]


@pytest.mark.parametrize("family", FAMILIES)
def test_a_familys_capabilities_decide_what_its_recipe_may_ask(family):
    """Packing and the vllm engine are refused exactly for the families whose registry entry says why."""
    from pathlib import Path

    from vlmrun.config.families import FAMILIES as REGISTRY
    from vlmrun.config.load import load_recipe

    recipes = Path(__file__).resolve().parents[1] / "recipes"
    asks = {
        "packing": (recipes / "tiny-clevr-cpu.yaml", ["data.pack_tokens=512"], "data.pack_tokens"),
        "vllm": (recipes / "tiny-grpo-cpu.yaml", ["generation.backend=vllm", "cluster.gpus_per_node=2"], "generation"),
    }
    for capability, (recipe, sets, field) in asks.items():
        why = getattr(REGISTRY[family].capabilities, capability)
        overrides = [f"model.family={family}", *sets]
        if why is None:
            load_recipe(recipe, overrides)
            continue
        with pytest.raises(InputError) as err:
            load_recipe(recipe, overrides)
        assert err.value.field.startswith(field) and why in str(err.value)
