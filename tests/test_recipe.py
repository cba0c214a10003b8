"""Recipe parsing, overrides and every class of validation error (names the field, the value, what's allowed)."""

from __future__ import annotations

import typing
from pathlib import Path

import pytest
import yaml

from vlmrun.config.cluster import parse_time_limit
from vlmrun.config.load import load_recipe, parse_override, read_yaml, set_dotted
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
    # SFT runs the local plane only (transfer_queue is refused for it with a message, see below)
    ("data_plane.impl", "local", ["data_plane.impl=local"], "local"),
    ("data_plane.backend", "simple", ["data_plane.backend=simple"], "simple"),
    ("model.backend", "hf", ["model.backend=hf"], "hf"),
    ("generation.backend", "hf", ["generation.backend=hf"], "hf"),
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
        ("data_plane.impl=transfer_queue", "data_plane.impl", "SFT runs with 'local'"),
        ("cluster.gpus_per_node=4", "parallel.dp", "must equal the allocation's GPUs"),
        ("data.family=nemotron_omni", "data.family", "must match model.family"),
        ("train.max_steps.x=1", "train.max_steps.x", "is a value, not a section"),
        ("parallel.mixed_precision=bf16", "parallel.mixed_precision", "needs parallel.fsdp: true"),
        ("parallel.fsdp=maybe", "parallel.fsdp", "valid boolean"),
        ("parallel.cpu_offload=true", "parallel.cpu_offload", "needs GPUs"),
        ("parallel.offload_during_generation=true", "parallel.offload_during_generation", "around GRPO's rollouts"),
        ("model.backend=deepspeed", "model.backend", "'hf' or 'megatron'"),
        ("generation.backend=sglang", "generation.backend", "'hf' or 'vllm'"),
        ("generation.backend=vllm", "generation.backend", "GRPO's rollouts"),  # an SFT recipe (a CPU GRPO one takes it)
        ("generation.engine=hf", "generation.engine", "valid keys are backend"),
        ("model.attn_implementation=flash", "model.attn_implementation", "'flash_attention_2'"),
        ("model.attn_implementation=flash_attention_2", "model.attn_implementation", "needs GPUs"),
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


# --- typing rules that hold for every field of every section (config/section.py) ---


def _leaves(model=None, prefix=""):
    """(dotted name, the plain types it accepts, is a tuple) of every leaf field of the recipe."""
    from pydantic import BaseModel

    from vlmrun.config.recipe import Recipe

    for name, info in (model or Recipe).model_fields.items():
        args = typing.get_args(info.annotation) or (info.annotation,)
        sub = next((a for a in args if isinstance(a, type) and issubclass(a, BaseModel)), None)
        if sub is not None:
            # a list of sections (grpo.rewards): its items' fields, set through a one-item list
            yield from _leaves(
                sub, f"{prefix}{name}[]." if typing.get_origin(info.annotation) is list else f"{prefix}{name}."
            )
            continue
        is_tuple = typing.get_origin(info.annotation) is tuple
        flat = {typing.get_args(a)[0] if typing.get_origin(a) is typing.Annotated else a for a in args}
        yield f"{prefix}{name}", flat, is_tuple


def _fields_of(*kinds):
    return [(name, is_tuple) for name, flat, is_tuple in _leaves() if flat & set(kinds)]


FLOATS = _fields_of(float)
NUMBERS = _fields_of(int, float)
BOOLS = _fields_of(bool)


def test_the_field_walk_sees_every_kind():
    names = [n for n, _ in FLOATS]
    assert {"train.lr", "train.betas", "train.min_lr_ratio"} <= set(names)
    assert len(NUMBERS) > 20 and ("model.tiny", False) in BOOLS


def _refused(override: str) -> InputError:
    if "[]." in override:  # an item's field: the item alone, its other required fields given
        listed, rest = override.split("[].", 1)
        leaf, value = rest.split("=", 1)
        override = f"{listed}=[{{fn: clevr_exact, {leaf}: {value}}}]"
    with pytest.raises(InputError) as e:
        load_recipe(TINY, [override])
    assert len(str(e.value).splitlines()) <= 2
    return e.value


@pytest.mark.parametrize("dotted, is_tuple", FLOATS, ids=[n for n, _ in FLOATS])
@pytest.mark.parametrize("bad", [".inf", "-.inf", ".nan", "1e400"])
def test_every_float_is_finite(dotted, is_tuple, bad):
    e = _refused(f"{dotted}=[{bad}, 0.5]" if is_tuple else f"{dotted}={bad}")
    assert e.field.startswith(dotted.split("[]")[0]) and "finite" in str(e)


@pytest.mark.parametrize("dotted, is_tuple", NUMBERS, ids=[n for n, _ in NUMBERS])
@pytest.mark.parametrize("bad", ["true", "false"])
def test_booleans_are_not_numbers(dotted, is_tuple, bad):
    e = _refused(f"{dotted}=[0.5, {bad}]" if is_tuple else f"{dotted}={bad}")
    assert e.field.startswith(dotted.split("[]")[0])


@pytest.mark.parametrize("dotted, is_tuple", BOOLS, ids=[n for n, _ in BOOLS])
@pytest.mark.parametrize("bad", ["1", "0", "1.0", "'true'"])
def test_numbers_are_not_booleans(dotted, is_tuple, bad):
    e = _refused(f"{dotted}={bad}")
    assert e.field.startswith(dotted) and "boolean" in str(e)


@pytest.mark.parametrize("betas", ["[1.0, 0.9]", "[0.9, 1]", "[-0.1, 0.9]", "[0.9, 1.5]", "[0.9]", "[0.1, 0.2, 0.3]"])
def test_betas_are_two_numbers_in_zero_one(betas):
    assert _refused(f"train.betas={betas}").field.startswith("train.betas")


def test_betas_in_range_and_exponent_floats_are_numbers():
    r = load_recipe(TINY, ["train.betas=[0, 0.999]", "train.lr=3e-4", "train.weight_decay=1E-2"])
    assert r.train.betas == (0.0, 0.999) and r.train.lr == 3e-4 and r.train.weight_decay == 0.01


def test_a_section_given_whole_is_merged_key_by_key():
    r = load_recipe(TINY, ["train={max_steps: 5}", "cluster={nodes: 1}", "checkpoint={requeue: {timeouts: 1}}"])
    assert r.train.max_steps == 5
    assert (r.train.lr, r.train.warmup_steps, r.train.global_batch_size) == (2.0e-3, 10, 8)  # the recipe's
    assert (r.cluster.time_limit, r.cluster.signal_delay_s) == (30, 60)
    assert (r.checkpoint.requeue.timeouts, r.checkpoint.requeue.preemptions) == (1, 3)
    assert load_recipe(TINY, ["data.synthetic=null"]).data.synthetic is None  # a value still replaces


def test_overrides_never_change_a_mapping_yaml_aliases_share(tmp_path):
    text = TINY.read_text().replace("synthetic: {", "synthetic: &syn {") + "logger: {wandb_project: x}\nextra: *syn\n"
    raw = read_yaml(write(tmp_path, text))
    set_dotted(raw, "data.synthetic.seed", 7)
    set_dotted(raw, "data.synthetic", {"train": 5})
    assert raw["extra"] == {"train": 2048, "val": 128, "image_size": 112, "seed": 0}
    assert raw["data"]["synthetic"] == {"train": 5, "val": 128, "image_size": 112, "seed": 7}


# --- bounded parsing: hostile YAML fails in well under a second, naming the file ---

LAUGHS = "a: &a [lol, lol, lol, lol, lol, lol, lol, lol, lol]\n" + "".join(
    f"{c}: &{c} [{', '.join([f'*{p}'] * 9)}]\n" for p, c in zip("abcdefgh", "bcdefghi", strict=True)
)


@pytest.mark.parametrize(
    "text, words",
    [
        (LAUGHS + "name: *i\n", "expands to more than"),
        (
            "l0: &l0 {x: 1, y: 2}\n"
            + "".join(f"l{i}: &l{i} {{<<: [*l{i - 1}, *l{i - 1}], k{i}: 1}}\n" for i in range(1, 40))
            + "name: x\n",
            "expands to more than",
        ),
        ("name: &a [*a]\n", "contains it"),
        ("name: " + "[" * 40 + "]" * 40 + "\n", "nested deeper than"),
        ("name: " + "[" * 20000 + "]" * 20000 + "\n", "nested deeper than"),
        ("name: x\ntrain: {max_steps: " + "9" * 5000 + "}\n", "cannot be built"),
        ("name: 2024-13-45\n", "cannot be built"),
    ],
    ids=["billion-laughs", "merge-keys", "cycle", "deep", "very-deep", "huge-int", "bad-date"],
)
def test_unbounded_yaml_is_refused_fast(tmp_path, text, words):
    import time

    path = write(tmp_path, text)
    t0 = time.process_time()  # this process's CPU: what the expansion would spend, whatever the machine's load
    with pytest.raises(InputError) as e:
        load_recipe(path)
    assert time.process_time() - t0 < 3
    msg = str(e.value)
    assert str(path) in msg and words in msg and len(msg) < 300


def test_a_huge_recipe_file_is_refused(tmp_path):
    path = write(tmp_path, "name: x\n" + "# padding\n" * 120_000)
    with pytest.raises(InputError, match="larger than"):
        load_recipe(path)


def test_a_bomb_in_a_set_value_is_refused():
    bomb = "{" + LAUGHS.replace("\n", ", ").rstrip(", ") + ", z: *i}"
    with pytest.raises(InputError, match="cluster.env: expands to more than"):
        load_recipe(TINY, [f"cluster.env={bomb}"])


def test_error_values_are_formatted_from_a_bounded_prefix():
    import time

    from vlmrun.errors import short_repr

    value: list = ["lol"] * 9
    for _ in range(40):  # 9**40 leaves, shared: the full repr could never be built
        value = [value] * 9
    t0 = time.process_time()
    text = str(InputError("name", value, "a string"))
    assert time.process_time() - t0 < 0.5 and len(text) < 120
    assert short_repr(10**5000).startswith("<integer of") and len(short_repr("x" * 10**7)) <= 80


def test_hsdp_shard_groups_must_divide_dp_need_fsdp_and_never_straddle_nodes():
    hsdp = load_recipe(TINY, ["parallel.dp=4", "cluster.cpus_per_node=4", "parallel.fsdp=true", "parallel.dp_shard=2"])
    p = hsdp.parallel.layout
    assert (p.shard_group, p.replicas) == (2, 2) and "dp=4 dp_shard=2" in p.describe()
    flat = load_recipe(TINY, ["parallel.fsdp=true"]).parallel.layout
    assert (flat.dp_shard, flat.shard_group, flat.replicas) == (None, 2, 1)
    for sets, field, words in (
        (
            ["parallel.dp=4", "cluster.cpus_per_node=4", "parallel.fsdp=true", "parallel.dp_shard=3"],
            "parallel.dp_shard",
            "must divide parallel.dp = 4",
        ),
        (["parallel.dp_shard=2"], "parallel.dp_shard", "needs parallel.fsdp: true"),
        (["parallel.dp_shard=0"], "parallel.dp_shard", "greater than or equal to 1"),
        (
            ["cluster.nodes=3", "cluster.gpus_per_node=4", "parallel.dp=12", "train.global_batch_size=24"]
            + ["parallel.fsdp=true", "parallel.dp_shard=6"],
            "parallel.dp_shard",
            "never part of two",
        ),
    ):
        with pytest.raises(InputError) as e:
            load_recipe(TINY, sets)
        assert e.value.field == field and words in str(e.value), (sets, str(e.value))
    from vlmrun.config.identity import IDENTITY_FIELDS, run_identity

    assert "parallel.dp_shard" in IDENTITY_FIELDS and run_identity(hsdp, model_contents=None)["parallel.dp_shard"] == 2
