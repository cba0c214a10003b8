"""Recipe parsing, overrides and every class of validation error (names the field, the value, what's allowed)."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from vlmrun.config.cluster import parse_time_limit
from vlmrun.config.load import load_recipe, parse_override
from vlmrun.errors import InputError

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


def field(recipe, dotted: str):
    for part in dotted.split("."):
        recipe = getattr(recipe, part)
    return recipe


# Keys that users' recipes, scripts and `--set` spell (README, the shipped recipes): each with its value
# in recipes/tiny-clevr-cpu.yaml (or the default, for keys that file leaves out), and a `--set` that must
# reach it with the field's type.
STABLE_KEYS = [
    ("train.max_steps", 200, ["train.max_steps=400"], 400),
    ("train.seed", 1234, ["train.seed=7"], 7),
    ("train.loop", "v2", ["train.loop=v1"], "v1"),
    ("train.global_batch_size", 8, ["train.global_batch_size=16"], 16),
    ("parallel.dp", 2, ["parallel.dp=1"], 1),
    ("checkpoint.save_period", 50, ["checkpoint.save_period=0"], 0),
    ("checkpoint.keep", 2, ["checkpoint.keep=5"], 5),
    ("cluster.nodes", 1, ["cluster.nodes=2"], 2),
    ("cluster.time_limit", 30, ["cluster.time_limit=01:30:00"], 90),
    # one implementation today (transfer_queue is refused with a message, see below): the keys and defaults hold
    ("data_plane.impl", "local", ["data_plane.impl=local"], "local"),
    ("data_plane.backend", "simple", ["data_plane.backend=simple"], "simple"),
]


@pytest.mark.parametrize("dotted, shipped, overrides, overridden", STABLE_KEYS, ids=[k[0] for k in STABLE_KEYS])
def test_stable_keys_keep_their_names_values_and_types(dotted, shipped, overrides, overridden):
    value = field(load_recipe(TINY), dotted)
    assert value == shipped and type(value) is type(shipped)
    value = field(load_recipe(TINY, overrides), dotted)
    assert value == overridden and type(value) is type(overridden)


def test_overrides_coerce_types():
    r = load_recipe(
        TINY,
        [
            "train.max_steps=7",
            "train.lr=3e-4",
            "train.loop=v1",
            "cluster.container_mounts=[/a:/a, /b:/b]",
            "cluster.time_limit=01:30:00",
            "logger.wandb_mode=disabled",
        ],
    )
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
@pytest.mark.parametrize(
    "text, minutes",
    [
        (30, 30),
        ("45", 45),
        ("01:30:00", 90),
        ("1-00:00:00", 1440),
        ("0:10", 1),
        ("90:00", 90),
        ("2-12", 3600),
        ("00:00:30", 1),
    ],
)
def test_time_limit(text, minutes):
    assert parse_time_limit(text) == minutes


def test_time_limit_rejects_zero():
    with pytest.raises(ValueError, match="at least 1 minute"):
        parse_time_limit(0)
