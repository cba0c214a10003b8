"""Recipe parsing, overrides and every class of validation error (names the field, the value, what's allowed)."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from vlmrun.errors import InputError
from vlmrun.config.cluster import parse_time_limit
from vlmrun.config.load import load_recipe, parse_override

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "recipes" / "tiny-clevr-cpu.yaml"


def write(tmp_path: Path, data) -> Path:
    p = tmp_path / "r.yaml"
    p.write_text(data if isinstance(data, str) else yaml.safe_dump(data))
    return p


@pytest.mark.parametrize("name", ["tiny-clevr-cpu.yaml", "qwen2.5-vl-3b-clevr-1n2g.yaml", "omni-clevr-1n8g.yaml"])
def test_shipped_recipes_validate(name):
    r = load_recipe(ROOT / "recipes" / name)
    assert r.train.algorithm == "sft" and r.train.loop == "v2"
    assert Path(r.data.path).is_absolute()


def test_stable_key_names_exist():
    r = load_recipe(TINY)
    for dotted in ["train.max_steps", "train.seed", "train.loop", "train.global_batch_size", "parallel.dp", "data.path",
                   "checkpoint.save_period", "checkpoint.keep", "cluster.nodes", "data_plane.impl", "data_plane.backend"]:
        obj = r
        for part in dotted.split("."):
            obj = getattr(obj, part)


def test_overrides_coerce_types():
    r = load_recipe(TINY, ["train.max_steps=7", "train.lr=3e-4", "train.loop=v1", "cluster.container_mounts=[/a:/a, /b:/b]",
                           "cluster.time_limit=01:30:00", "logger.wandb_mode=disabled"])
    assert r.train.max_steps == 7 and r.train.lr == pytest.approx(3e-4) and r.train.loop == "v1"
    assert r.cluster.container_mounts == ["/a:/a", "/b:/b"] and r.cluster.time_limit == 90


@pytest.mark.parametrize(
    "override, field, words",
    [
        ("train.lr=abc", "train.lr", "valid number"),
        ("train.max_steps=-5", "train.max_steps", "greater than or equal to 1"),
        ("train.loop=v3", "train.loop", "'v1' or 'v2'"),
        ("train.lrr=1", "train.lrr", "did you mean train.lr"),
        ("no_such_section.x=1", "no_such_section", "valid keys are"),
        ("parallel.dp=3", "train.global_batch_size", "divisible by parallel.dp"),
        ("data_plane.backend=mooncake", "data_plane", "transfer_queue"),
        ("cluster.partition=gpu;rm -rf /", "cluster.partition", "pattern"),
        ("cluster.env={'BAD KEY': x}", "cluster.env", "environment variable name"),
        ("name=a$(id)", "name", "pattern"),
        ("name=x\ny", "name", "pattern"),
        ("cluster.time_limit=soon", "cluster.time_limit", "HH:MM:SS"),
        ("model.path=/m", "model", "exactly one of model.path"),
        ("train.algorithm=grpo", "train.algorithm", "'sft' only"),
        ("cluster.gpus_per_node=4", "parallel.dp", "must equal the allocation's GPUs"),
        ("data.family=nemotron_omni", "data.family", "must match model.family"),
        ("train.max_steps.x=1", "train.max_steps.x", "is a value, not a section"),
    ],
)
def test_bad_values_name_field_value_and_allowed(override, field, words):
    with pytest.raises(InputError) as e:
        load_recipe(TINY, [override])
    msg = str(e.value)
    assert msg.startswith(field) or field in msg
    assert words in msg
    assert len(msg.splitlines()) <= 2


@pytest.mark.parametrize("item", ["train.max_steps", "=3", "a..b=1", "train.max-steps=3"])
def test_malformed_override(item):
    with pytest.raises(InputError, match="--set"):
        parse_override(item)


def test_file_errors(tmp_path):
    with pytest.raises(InputError, match="not found"):
        load_recipe(tmp_path / "missing.yaml")
    with pytest.raises(InputError, match="line 3 column 1: malformed YAML"):
        load_recipe(write(tmp_path, "name: x\nmodel: [unclosed\n"))
    with pytest.raises(InputError, match="YAML mapping"):
        load_recipe(write(tmp_path, "- a\n- b\n"))
    with pytest.raises(InputError, match="model: required field is missing"):
        load_recipe(write(tmp_path, {"name": "x", "data": {"path": "d"}}))


def test_relative_paths_resolve_against_base(tmp_path):
    r = load_recipe(TINY, ["checkpoint.dir=ck"], base_dir=tmp_path)
    assert r.data.path == str(tmp_path / "data" / "tiny-clevr-112")
    assert r.checkpoint.dir == str(tmp_path / "ck")


# SLURM's forms, read as sbatch reads them: M:S is minutes and seconds (seconds round up to a minute).
@pytest.mark.parametrize("text, minutes", [(30, 30), ("45", 45), ("01:30:00", 90), ("1-00:00:00", 1440), ("0:10", 1),
                                           ("90:00", 90), ("2-12", 3600), ("00:00:30", 1)])
def test_time_limit(text, minutes):
    assert parse_time_limit(text) == minutes


def test_time_limit_rejects_zero():
    with pytest.raises(ValueError):
        parse_time_limit(0)
