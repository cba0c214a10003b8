"""The memory-fit check at submit: parameter counts from config.json alone, the estimate, and the verdict
(a GPU recipe that cannot fit exits 2 naming what to change; within 10% of the GPU it warns)."""

from __future__ import annotations

import importlib.util
import json
import re
from dataclasses import replace
from pathlib import Path

import pytest
from vlmrun_cli import vlmrun

from vlmrun.config.families import FAMILIES
from vlmrun.config.load import load_recipe
from vlmrun.errors import InputError
from vlmrun.models.architecture import REFERENCE_DIR, load_architecture
from vlmrun.models.fit import SYNTHETIC_ANSWER_TOKENS, check_memory_fit, device_bytes, training_shape
from vlmrun.models.memory import GIB, TrainingShape, estimate_memory
from vlmrun.models.params import UnknownArchitecture, count_architecture

ROOT = Path(__file__).resolve().parents[1]
RECIPES = ROOT / "recipes"
OMNI = RECIPES / "omni-clevr-1n8g.yaml"
TINY = RECIPES / "tiny-clevr-cpu.yaml"
GPU_RECIPES = [
    "omni-clevr-1n8g.yaml",
    "omni-clevr-grpo-1n8g.yaml",
    "qwen2.5-vl-3b-clevr-1n2g.yaml",
    "qwen2.5-vl-3b-clevr-grpo-1n2g.yaml",
]
# the 30B on one 80 GiB GPU, its whole training state on the GPU
ONE_GPU = [
    "parallel.dp=1",
    "cluster.gpus_per_node=1",
    "parallel.cpu_offload=false",
    "parallel.reduce_every_micro_batch=false",
]


def placeholder_model(tmp_path: Path) -> Path:
    """A model directory whose config.json describes nothing (the weights live elsewhere)."""
    d = tmp_path / "model"
    d.mkdir(exist_ok=True)
    (d / "config.json").write_text("{}")
    return d


def reference(name: str) -> dict:
    config = json.loads((REFERENCE_DIR / f"{name}.json").read_text())
    config.pop("source", None)
    return config


# ---------------------------------------------------------------- the verdict


def test_30b_on_one_gpu_is_refused_naming_the_fields_to_change():
    with pytest.raises(InputError) as e:
        check_memory_fit(load_recipe(OMNI, ONE_GPU))
    msg = str(e.value)
    assert e.value.field == "cluster.gpu_memory_gb" and len(msg.splitlines()) == 1
    assert "the 79.6 GiB of cluster.gpu_memory_gb=80" in msg and "33.02B parameters" in msg
    for part in ("weights 123.0", "gradients 123.0", "optimizer 246.0", "accumulated gradients 123.0", "overhead"):
        assert part in msg
    for field in (
        "parallel.cpu_offload=true",
        "parallel.dp",
        "parallel.reduce_every_micro_batch",
        "cluster.gpu_memory_gb",
    ):
        assert field in msg


def test_cli_refuses_with_exit_2_before_any_run_dir(tmp_path):
    sets = [f"model.path={placeholder_model(tmp_path)}", *ONE_GPU]
    out = vlmrun(
        "submit", str(OMNI), "--dry-run", "--cluster", "slurm", *[a for s in sets for a in ("--set", s)], cwd=tmp_path
    )
    assert out.returncode == 2, out.stdout + out.stderr
    assert "Traceback" not in out.stderr and len(out.stderr.strip().splitlines()) <= 2
    assert "cluster.gpu_memory_gb" in out.stderr and "parallel.cpu_offload=true" in out.stderr
    assert not (tmp_path / "runs").exists()


@pytest.mark.parametrize("name", GPU_RECIPES)
def test_shipped_gpu_recipes_fit_their_80_gib_gpus(name):
    fit = check_memory_fit(load_recipe(RECIPES / name))
    assert fit.warning is None and fit.limit == device_bytes(80) == int(81559 * 2**20)
    assert fit.estimate.device_total < 0.9 * fit.limit
    assert fit.source.startswith("vlmrun/models/reference/") and "model.reference_config" in fit.source_note
    assert fit.host_limit is None or fit.host_per_node < 0.9 * fit.host_limit


def test_omni_1n8g_offloads_its_state_to_the_hosts_memory():
    fit = check_memory_fit(load_recipe(OMNI))
    e = fit.estimate
    assert e.offloaded and e.params == 33_015_727_040
    assert fit.host_per_node == 8 * e.host_per_rank and fit.host_per_node < 1000 * GIB
    with pytest.raises(InputError, match="cluster.mem_gb"):
        check_memory_fit(load_recipe(OMNI, ["cluster.mem_gb=400"]))


def test_host_memory_at_load_counts_a_share_per_sharded_rank_and_the_whole_model_per_replica():
    """Sharded, each rank reads only its rows of the files (models/sharded_load.py): its share plus the
    staging buffer and its largest shard on the way to the GPU; replicated, `from_pretrained` holds the
    whole model on every rank. A node whose ranks cannot load within cluster.mem_gb is refused."""
    qwen3b = RECIPES / "qwen2.5-vl-3b-clevr-1n2g.yaml"
    sharded = check_memory_fit(load_recipe(qwen3b)).estimate
    replicated = ["parallel.fsdp=false", "model.dtype=bfloat16", "parallel.mixed_precision=none"]
    whole = check_memory_fit(load_recipe(qwen3b, replicated)).estimate
    assert whole.load_host == whole.params * 2 and not whole.load_sharded  # bf16 weights, whole, on each rank
    assert sharded.load_sharded and sharded.weights + (64 << 20) < sharded.load_host < 0.6 * sharded.params * 4
    with pytest.raises(InputError, match=r"cluster.mem_gb: loading the model .*each the whole model\).*fsdp=true"):
        check_memory_fit(load_recipe(qwen3b, [*replicated, "cluster.mem_gb=12"]))
    check_memory_fit(load_recipe(qwen3b, ["cluster.mem_gb=20"]))  # 2 x ~7.7 GiB: each rank its share
    with pytest.raises(InputError, match=r"cluster.mem_gb: loading the model .*each its share"):
        check_memory_fit(load_recipe(qwen3b, ["cluster.mem_gb=10"]))


def test_offload_during_generation_takes_the_policy_off_the_gpu_for_the_rollout_and_onto_the_host():
    """The optimizer's state leaves the GPU for the refit, the weights and the reference for the
    generation; the host holds them meanwhile. A CPU rank's host is its device: nothing changes there."""
    qwen3b = RECIPES / "qwen2.5-vl-3b-clevr-grpo-1n2g.yaml"
    kept = check_memory_fit(load_recipe(qwen3b, ["grpo.kl_coef=0.01"])).estimate
    moved = check_memory_fit(load_recipe(qwen3b, ["grpo.kl_coef=0.01", "parallel.offload_during_generation=true"]))
    e = moved.estimate
    assert e.reference == e.weights > 0 and e.optimizer == 2 * e.weights
    assert e.phase_total("refit") == kept.phase_total("refit") - e.optimizer
    assert e.phase_total("generation") == kept.phase_total("generation") - e.optimizer - e.weights - e.reference
    assert {p: e.phase_total(p) for p in ("forward", "backward")} == {
        p: kept.phase_total(p) for p in ("forward", "backward")
    }
    assert e.rollout_host == e.weights + e.reference + e.optimizer and moved.host_per_node == 2 * e.rollout_host
    assert "moved there for the rollout" in "\n".join(moved.report_lines())
    with pytest.raises(InputError, match=r"cluster.mem_gb: parallel.offload_during_generation moves ~"):
        check_memory_fit(load_recipe(qwen3b, ["parallel.offload_during_generation=true", "cluster.mem_gb=40"]))
    with pytest.raises(InputError, match="parallel.offload_during_generation: .*cpu_offload: true"):
        load_recipe(qwen3b, ["parallel.offload_during_generation=true", "parallel.cpu_offload=true"])
    cpu = RECIPES / "tiny-grpo-cpu.yaml"
    assert check_memory_fit(load_recipe(cpu, ["parallel.offload_during_generation=true"])).to_json() == (
        check_memory_fit(load_recipe(cpu)).to_json()
    )


def test_a_rollout_that_does_not_fit_names_offload_during_generation():
    """The Omni GRPO recipe with its state on the GPUs peaks while it generates (the engine's 61.5 GiB
    beside the policy's shards); moving the policy off the GPU for the rollout is one of the changes
    its refusal names, with the estimate it gives (the check of each claim: the test above)."""
    on_gpu = load_recipe(RECIPES / "omni-clevr-grpo-1n8g.yaml", ["parallel.cpu_offload=false"])
    with pytest.raises(InputError) as e:
        check_memory_fit(on_gpu)
    assert "(end of the generation)" in str(e.value)
    claimed = dict(REMEDY.findall(str(e.value)))
    after = check_memory_fit(
        load_recipe(
            RECIPES / "omni-clevr-grpo-1n8g.yaml",
            ["parallel.cpu_offload=false", "parallel.offload_during_generation=true", "cluster.gpu_memory_gb=4096"],
        )
    ).estimate
    assert float(claimed["parallel.offload_during_generation=true"]) == round(after.device_total / GIB, 1)
    assert after.peak_phase == "backward"  # the rollout no longer sets the peak


def test_within_10_percent_warns_and_the_dry_run_shows_it(tmp_path):
    estimate = check_memory_fit(load_recipe(OMNI)).estimate.device_total
    tight = next(gb for gb in range(1, 4097) if device_bytes(gb) >= estimate)  # the smallest GPU it fits on
    fit = check_memory_fit(load_recipe(OMNI, [f"cluster.gpu_memory_gb={tight}"]))
    assert fit.warning and "within 10%" in fit.warning and "cluster.gpu_memory_gb" in fit.warning
    sets = [f"model.path={placeholder_model(tmp_path)}", f"cluster.gpu_memory_gb={tight}"]
    out = vlmrun(
        "submit", str(OMNI), "--dry-run", "--cluster", "slurm", *[a for s in sets for a in ("--set", s)], cwd=tmp_path
    )
    assert out.returncode == 0, out.stderr
    assert "# warning: the estimate" in out.stdout and "# memory estimate per GPU: 33.02B parameters" in out.stdout


def test_dry_run_json_carries_the_estimate(tmp_path):
    out = vlmrun(
        "submit",
        str(OMNI),
        "--dry-run",
        "--cluster",
        "slurm",
        "--json",
        "--set",
        f"model.path={placeholder_model(tmp_path)}",
        cwd=tmp_path,
    )
    assert out.returncode == 0, out.stderr
    data = json.loads(out.stdout)
    assert {"run_dir", "cluster", "dry_run", "recipe", "sbatch_script"} <= data.keys()
    memory = data["memory_estimate"]
    assert memory["config"] == "vlmrun/models/reference/nemotron_omni_30b_a3b.json"
    assert memory["device_total"] < memory["limit_bytes"] == device_bytes(80) and memory["warning"] is None
    assert memory["tokens_per_s"] == memory["throughput_estimate"]["tokens_per_s"] > 0 and memory["phase_totals"]


def test_the_dry_run_prints_a_tokens_per_second_estimate_that_says_it_is_one(tmp_path):
    out = vlmrun(
        "submit", str(OMNI), "--dry-run", "--cluster", "slurm", "--set", f"model.path={placeholder_model(tmp_path)}"
    )
    assert out.returncode == 0, out.stderr
    line = next(x for x in out.stdout.splitlines() if x.startswith("# throughput:"))
    assert "tokens/s per GPU (estimate)" in line and "traffic" in line and "host" in line


def test_the_throughput_estimate_sees_what_bounds_a_step():
    """The Omni layout is bound by its traffic (every micro-batch gathers the 33B model; offloaded shards
    cross PCIe), the 3B by its FLOPs; a GPU rank's host threads shorten the offloaded optimizer step."""
    omni = check_memory_fit(load_recipe(OMNI)).throughput
    small = check_memory_fit(load_recipe(OMNI, ["train.micro_batch_size=1"])).throughput
    one_thread = check_memory_fit(load_recipe(OMNI, ["cluster.cpus_per_node=8"])).throughput
    qwen = check_memory_fit(load_recipe(RECIPES / "qwen2.5-vl-3b-clevr-1n2g.yaml")).throughput
    assert omni.traffic_s > 10 * omni.compute_s and qwen.compute_s > 3 * qwen.traffic_s
    assert small.tokens_per_step == omni.tokens_per_step and small.traffic_s == 8 * omni.traffic_s
    assert omni.tokens_per_s > 3 * small.tokens_per_s
    assert one_thread.host_s == 8 * omni.host_s and omni.host_s > 0 == qwen.host_s
    assert check_memory_fit(load_recipe(TINY)).throughput is None  # a CPU recipe: no GPU rate to estimate


def test_cpu_recipes_are_estimated_never_refused():
    fit = check_memory_fit(load_recipe(TINY, ["cluster.gpu_memory_gb=1", "data.max_seq_len=65536"]))
    assert fit.limit is None and fit.warning is None and fit.estimate.overhead == 0
    assert fit.source == "vlmrun/models/reference/tiny_qwen2_5_vl.json"


def test_a_config_that_cannot_be_counted_is_reported_not_refused(tmp_path):
    recipe = load_recipe(OMNI, [f"model.path={placeholder_model(tmp_path)}", "model.reference_config=null"])
    fit = check_memory_fit(recipe)
    assert fit.estimate is None and "model.reference_config" in fit.warning
    assert "memory fit not checked" in fit.report_lines()[0]


def test_a_readable_config_json_wins_over_the_reference(tmp_path):
    d = tmp_path / "qwen"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(reference("qwen2_5_vl_3b")))
    recipe = load_recipe(RECIPES / "qwen2.5-vl-3b-clevr-1n2g.yaml", [f"model.path={d}"])
    found = load_architecture(recipe.model)
    assert found.source == str(d / "config.json") and found.architecture.total == 3_754_622_976


@pytest.mark.parametrize(
    "name, words", [("no_such_model", "choose one of"), ("qwen2_5_vl_3b", "not model.family nemotron_omni")]
)
def test_a_bad_reference_config_names_the_field(tmp_path, name, words):
    recipe = load_recipe(OMNI, [f"model.path={placeholder_model(tmp_path)}", f"model.reference_config={name}"])
    with pytest.raises(InputError, match=words) as e:
        check_memory_fit(recipe)
    assert e.value.field == "model.reference_config"


REMEDY = re.compile(r"([\w.]+=[\w.]+(?: with [\w.]+=[\w.]+)?) \(-> ([\d.]+) GiB\)")


@pytest.mark.parametrize(
    "name, sets",
    [
        ("omni-clevr-1n8g.yaml", ONE_GPU),
        ("qwen2.5-vl-3b-clevr-grpo-1n2g.yaml", ["cluster.gpu_memory_gb=20"]),
        (
            "qwen2.5-vl-3b-clevr-1n2g.yaml",
            ["cluster.gpu_memory_gb=40", "parallel.fsdp=false", "parallel.mixed_precision=none"],
        ),
    ],
)
def test_a_refusal_names_only_changes_that_lower_the_estimate(name, sets):
    with pytest.raises(InputError) as e:
        check_memory_fit(load_recipe(RECIPES / name, sets))
    message = str(e.value)
    before = float(re.search(r"needs ~([\d.]+) GiB", message)[1])
    remedies = REMEDY.findall(message)
    assert remedies and message.endswith("or bigger GPUs (cluster.gpu_memory_gb)")
    for change, claimed in remedies:  # each one, applied, gives the estimate it claims, lower than before
        overrides = [part.strip() for part in change.split(" with ")]
        after = check_memory_fit(load_recipe(RECIPES / name, [*sets, *overrides, "cluster.gpu_memory_gb=4096"]))
        assert round(after.estimate.device_total / GIB, 1) == float(claimed) < before, change
    assert [float(c) for _, c in remedies] == sorted(float(c) for _, c in remedies)


def test_a_refusal_leaves_out_what_does_not_move_the_peak():
    # the 30B on one GPU peaks at the end of the backward: activations and sequence length do not set it
    with pytest.raises(InputError) as e:
        check_memory_fit(load_recipe(OMNI, ONE_GPU))
    for field in ("parallel.activation_checkpointing", "data.max_seq_len", "train.micro_batch_size", "parallel.fsdp="):
        assert field not in str(e.value)


def test_tiny_on_a_gpu_recipe_estimates_the_tiny_model_and_says_the_reference_is_unused():
    recipe = load_recipe(RECIPES / "qwen2.5-vl-3b-clevr-1n2g.yaml", ["model.path=null", "model.tiny=true"])
    fit = check_memory_fit(recipe)
    assert fit.source == "vlmrun/models/reference/tiny_qwen2_5_vl.json" and fit.estimate.params < 1e6
    assert (
        "model.reference_config=qwen2_5_vl_3b is not used: model.tiny trains the tiny qwen2_5_vl model" in fit.warning
    )
    assert f"warning: {fit.warning}" in fit.report_lines()


def test_the_memory_check_refuses_a_model_of_another_family(tmp_path):
    d = tmp_path / "qwen"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(reference("qwen2_5_vl_3b")))
    with pytest.raises(InputError, match="describes a 'qwen2_5_vl' model") as e:
        check_memory_fit(load_recipe(OMNI, [f"model.path={d}"]))
    assert e.value.field == "model.family"


# ---------------------------------------------------------------- the estimate's terms


def test_each_setting_moves_the_term_it_should():
    arch = count_architecture("qwen2_5_vl", reference("qwen2_5_vl_3b"))
    base = TrainingShape(fsdp=True, dp=2, sequences=4, seq_len=2048)
    e = estimate_memory(arch, base)
    assert e.weights == e.gradients == -(-arch.total // 2) * 4 and e.optimizer == 2 * e.weights
    assert estimate_memory(arch, replace(base, dp=4)).weights == -(-arch.total // 4) * 4
    assert estimate_memory(arch, TrainingShape(sequences=4, seq_len=2048)).gathered_params == 0
    assert estimate_memory(arch, TrainingShape(optimizer="sgd")).optimizer == 0
    checkpointed = estimate_memory(
        arch, TrainingShape(fsdp=True, dp=2, sequences=4, seq_len=2048, activation_checkpointing=True)
    )
    assert checkpointed.activations < e.activations / 10
    bf16 = estimate_memory(arch, TrainingShape(fsdp=True, dp=2, sequences=4, seq_len=2048, mixed_precision="bf16"))
    assert bf16.weights == e.weights and bf16.activations == e.activations // 2
    offloaded = estimate_memory(arch, TrainingShape(fsdp=True, dp=2, cpu_offload=True))
    assert offloaded.host_per_rank == offloaded.sharded_state and not any(offloaded.resident_terms().values())
    accumulating = estimate_memory(arch, replace(base, micro_batches=2, mixed_precision="bf16"))
    assert accumulating.accumulated_gradients == arch.total * 4  # unsharded, fp32, whatever dp is
    shape = TrainingShape(
        fsdp=True, dp=2, reference_model=True, generation_sequences=8, engine=True, engine_resident=True
    )
    grpo = estimate_memory(arch, replace(shape, refit_bucket=256 << 20))
    assert grpo.reference == grpo.weights and grpo.engine_weights == arch.total * 4  # the engine's own copy, any dp
    assert grpo.resident_terms()["generation engine"] == grpo.engine_weights and grpo.generation > 0
    released = estimate_memory(arch, replace(shape, refit_bucket=256 << 20, engine_resident=False))
    phases = released.phase_terms()
    assert released.resident_terms()["generation engine"] == 0  # generation.release_weights
    assert phases["refit"]["generation engine"] == phases["generation"]["generation engine"] == arch.total * 4
    assert phases["refit"]["refit bucket"] == 256 << 20 and released.device_total < grpo.device_total
    sft_validation = estimate_memory(arch, replace(base, engine=True, refit_bucket=1 << 20))
    assert "generation" not in sft_validation.phase_terms() and sft_validation.phase_terms()["refit"]


def test_the_rollout_counts_every_sequence_of_the_step_s_one_generate_call():
    """GrpoWorker.rollout samples the replica's whole step in one call: global_batch_size / dp prompts,
    each num_generations times, not one micro-batch's (the slow test below runs the worker)."""
    for name, sequences in (("omni-clevr-grpo-1n8g.yaml", 32 * 8 // 8), ("qwen2.5-vl-3b-clevr-grpo-1n2g.yaml", 16 * 8)):
        fit = check_memory_fit(load_recipe(RECIPES / name))
        shape = training_shape(load_recipe(RECIPES / name))[0]
        assert shape.generation_sequences == sequences
        assert f"the rollout generates {sequences} sequences in one call" in fit.assumption
    one = check_memory_fit(load_recipe(RECIPES / "qwen2.5-vl-3b-clevr-grpo-1n2g.yaml")).estimate
    two = check_memory_fit(load_recipe(RECIPES / "qwen2.5-vl-3b-clevr-grpo-1n2g.yaml", ["train.global_batch_size=64"]))
    assert two.estimate.generation > 1.9 * one.generation  # twice the prompts per call, twice the KV cache


def test_gpu_sft_validation_answers_with_the_sharded_policy_and_holds_no_engine_copy():
    """On GPUs with a sharded hf policy SFT's validation generates with the policy's own model (worker.py):
    no refit phase with a whole bf16 copy; a CPU run, or a replicated one, still opens an engine."""
    omni = check_memory_fit(load_recipe(OMNI)).estimate
    assert load_recipe(OMNI).validates_with_the_policy and "refit" not in omni.phase_terms()
    assert omni.peak_phase == "backward" and omni.engine_weights == 0
    tiny = check_memory_fit(load_recipe(TINY)).estimate
    assert not load_recipe(TINY).validates_with_the_policy and "refit" in tiny.phase_terms()
    grpo = load_recipe(RECIPES / "omni-clevr-grpo-1n8g.yaml")
    assert not grpo.validates_with_the_policy  # GRPO validates with its own engine


def test_an_image_is_bounded_by_the_sequence_where_the_data_does_not_say():
    """A user's data (data.synthetic unset) may hold images as large as data.max_seq_len tokens: the
    estimate sizes the vision tower's activations for that one, not for 448 px."""
    arch = count_architecture("qwen2_5_vl", reference("qwen2_5_vl_3b"))
    qwen3b = RECIPES / "qwen2.5-vl-3b-clevr-1n2g.yaml"
    synthetic, said = training_shape(load_recipe(qwen3b), arch)
    user = load_recipe(qwen3b, ["data.synthetic=null", "data.max_seq_len=4096"])
    bounded, said_user = training_shape(user, arch)
    assert synthetic.image_size == 448 and bounded.image_size == 128 * 14  # 16384 patches = 4096 tokens
    assert "the largest image 4096 tokens (data.max_seq_len) hold" in said_user
    assert estimate_memory(arch, bounded).vision_activations > 10 * estimate_memory(arch, synthetic).vision_activations


def test_sft_counts_logits_for_the_labelled_tokens_only_where_the_data_bounds_them():
    qwen3b = RECIPES / "qwen2.5-vl-3b-clevr-1n2g.yaml"
    clevr = check_memory_fit(load_recipe(qwen3b)).estimate
    user = check_memory_fit(load_recipe(qwen3b, ["data.synthetic=null", "data.max_seq_len=512"])).estimate
    assert training_shape(load_recipe(qwen3b))[0].scored_tokens == SYNTHETIC_ANSWER_TOKENS
    assert clevr.logits == 4 * SYNTHETIC_ANSWER_TOKENS * clevr_vocab(qwen3b) * (2 + 8)
    assert user.logits == 4 * 512 * clevr_vocab(qwen3b) * (2 + 8)  # a user's answers may be any length


def clevr_vocab(recipe: Path) -> int:
    return load_architecture(load_recipe(recipe).model).architecture.vocab


@pytest.mark.slow
@pytest.mark.parametrize("family", FAMILIES)
def test_a_synthetic_clevr_sample_labels_at_most_the_tokens_the_estimate_counts(family, clevr_set, tiny_dirs):
    pytest.importorskip("torch")
    from data_samples import make_recipe

    from vlmrun.data.batch import IGNORE_INDEX
    from vlmrun.data.loader import val_batches

    recipe = make_recipe(clevr_set, family=family)
    loss_batches, _, _ = val_batches(recipe, processor_dir=tiny_dirs[family], samples=64, batch_size=4)
    labelled = [int(n) for b in loss_batches for n in (b.labels != IGNORE_INDEX).sum(dim=1)]
    assert len(labelled) >= 16 and 0 < max(labelled) <= SYNTHETIC_ANSWER_TOKENS  # every val sample


@pytest.mark.slow
def test_one_generate_call_holds_the_sequences_the_estimate_counts(clevr_set, tiny_dirs):
    """The GRPO rank itself (in this process, the driver path): the prompts of its replica's step, as the
    controller hands them over, go to the engine in one call of as many sequences as the fit check counts."""
    pytest.importorskip("torch")
    from data_samples import free_port, make_recipe

    from vlmrun.algorithms.common.steps import plan_steps
    from vlmrun.algorithms.grpo.worker import GrpoWorker
    from vlmrun.data.loader import val_batches

    sets = {"task_encoder": "chat_grpo"}
    train = {"algorithm": "grpo", "micro_batch_size": 2, "global_batch_size": 8}
    recipe = make_recipe(clevr_set, train=train, dp=2, **sets).model_copy(
        update={"grpo": load_recipe(RECIPES / "tiny-grpo-cpu.yaml").grpo.model_copy(update={"num_generations": 3})}
    )
    n_micro = plan_steps(recipe, 64).micro_batches_per_replica
    _, prompts, _ = val_batches(recipe, processor_dir=tiny_dirs["qwen2_5_vl"], samples=2 * n_micro, batch_size=2)
    worker = GrpoWorker(
        rank=0,
        world_size=1,
        recipe_json=recipe.model_dump_json(),
        model_dir=tiny_dirs["qwen2_5_vl"],
        plane_enabled=False,
    )
    calls = []
    try:
        worker.setup("127.0.0.1", free_port(), 1)
        generate = worker.generator.generate
        worker.generator.generate = lambda batch, sampling, *, n: (
            calls.append(len(batch) * n) or generate(batch, sampling, n=n)
        )
        worker.rollout(1, prompts=prompts[:n_micro])
    finally:
        worker.shutdown()
    assert calls == [training_shape(recipe)[0].generation_sequences] == [4 * 3]


# ---------------------------------------------------------------- counts against transformers


def _meta_count(config) -> int:
    torch = pytest.importorskip("torch")
    from transformers import AutoModelForImageTextToText

    with torch.device("meta"):
        model = AutoModelForImageTextToText.from_config(config)
    return sum(p.numel() for p in model.parameters())


@pytest.mark.slow
@pytest.mark.parametrize("family", FAMILIES)
def test_tiny_counts_match_the_builders_model(family):
    pytest.importorskip("transformers")
    from vlmrun.models.tiny import family_module
    from vlmrun.models.tiny.tokenizer import train_tokenizer

    module = family_module(family)
    config = module.build_config(train_tokenizer(module.TOKENIZER_SPEC))
    expected = _meta_count(config)
    assert count_architecture(family, config.to_dict()).total == expected
    snapshot = count_architecture(family, reference(f"tiny_{family}"))  # what a dry run of a tiny recipe counts
    assert snapshot.total == expected and snapshot.vocab == config.text_config.vocab_size


@pytest.mark.slow
@pytest.mark.parametrize(
    "family, name, total",
    [("qwen2_5_vl", "qwen2_5_vl_3b", 3_754_622_976), ("nemotron_omni", "nemotron_omni_30b_a3b", 33_015_727_040)],
)
def test_reference_counts_match_meta_instantiation(family, name, total):
    from transformers import AutoConfig

    config = reference(name)
    assert count_architecture(family, config).total == total == _meta_count(AutoConfig.for_model(**config))


LEGACY_OMNI = {  # the released checkpoints' key names: llm_config, sound_config, vit_hidden_size, a pattern string
    "model_type": "nemotron_h_omni",
    "vit_hidden_size": 32,
    "projector_hidden_size": 48,
    "vision_config": {
        "patch_size": 16,
        "hidden_size": 32,
        "num_hidden_layers": 2,
        "num_attention_heads": 2,
        "max_img_size": 256,
        "video_temporal_patch_size": 2,
    },
    "sound_config": {
        "hidden_size": 64,
        "num_attention_heads": 4,
        "num_hidden_layers": 2,
        "intermediate_size": 128,
        "subsampling_conv_channels": 16,
        "num_mel_bins": 128,
        "projection_hidden_size": 96,
        "projection_bias": False,
    },
    "llm_config": {
        "model_type": "nemotron_h",
        "vocab_size": 300,
        "hidden_size": 64,
        "hybrid_override_pattern": "ME*-",
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "intermediate_size": 96,
        "mamba_num_heads": 4,
        "mamba_head_dim": 16,
        "ssm_state_size": 16,
        "n_groups": 2,
        "n_routed_experts": 4,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 32,
        "moe_shared_expert_intermediate_size": 48,
        "num_nextn_predict_layers": 1,
    },
}


@pytest.mark.slow
def test_legacy_key_names_count_like_transformers_reads_them():
    from transformers import AutoConfig

    assert count_architecture("nemotron_omni", LEGACY_OMNI).total == _meta_count(AutoConfig.for_model(**LEGACY_OMNI))
    flat = reference("qwen2_5_vl_3b")  # Qwen2.5-VL's own config.json: text keys at the top level
    text = flat.pop("text_config")
    flat |= {k: v for k, v in text.items() if k != "model_type"} | {"num_hidden_layers": 2}
    flat["vision_config"]["depth"] = 2
    assert count_architecture("qwen2_5_vl", flat).total == _meta_count(AutoConfig.for_model(**flat))


QWEN_TEXT = {"num_hidden_layers": 2, "hidden_size": 256, "num_attention_heads": 4, "intermediate_size": 512}
QWEN_DEFAULTS = [  # what a config leaves out counts as the config class's default, not as a guess
    # Qwen2-VL's released layout: text keys at the top level; 8 key/value heads; tied at the top
    {
        "model_type": "qwen2_vl",
        **QWEN_TEXT,
        "vocab_size": 1000,
        "tie_word_embeddings": True,
        "vision_config": {"depth": 2},
    },
    {
        "model_type": "qwen2_vl",
        "text_config": {**QWEN_TEXT, "vocab_size": 1000, "num_key_value_heads": 2},
        "vision_config": {"depth": 2, "embed_dim": 64, "mlp_ratio": 3, "hidden_size": 256},
    },
    # Qwen3-VL: head_dim 128 and 32 key/value heads by default; a tie inside text_config is not read
    {
        "model_type": "qwen3_vl",
        "text_config": {**QWEN_TEXT, "vocab_size": 1000, "tie_word_embeddings": True},
        "vision_config": {"depth": 2},
    },
    {
        "model_type": "qwen3_vl",
        "tie_word_embeddings": True,
        "text_config": {**QWEN_TEXT, "vocab_size": 1000, "attention_bias": True, "num_key_value_heads": 2},
        "vision_config": {"depth": 3, "deepstack_visual_indexes": [0, 1], "num_position_embeddings": 64},
    },
]


@pytest.mark.slow
@pytest.mark.parametrize("config", QWEN_DEFAULTS, ids=lambda c: c["model_type"])
def test_qwen_defaults_count_like_transformers_reads_them(config):
    from transformers import AutoConfig

    from vlmrun.config.families import family_of_model_type

    family = family_of_model_type(config["model_type"])
    assert count_architecture(family, config).total == _meta_count(AutoConfig.for_model(**config))


def test_an_empty_config_is_unknown():
    for family in FAMILIES:
        with pytest.raises(UnknownArchitecture):
            count_architecture(family, {})


# ---------------------------------------------------------------- the estimate against a measurement


@pytest.mark.slow
def test_tiny_estimate_is_within_2x_of_the_measured_peak():
    pytest.importorskip("torch")
    spec = importlib.util.spec_from_file_location("measure_memory", ROOT / "tools" / "measure_memory.py")
    measure = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(measure)
    for family in FAMILIES:
        recipe = load_recipe(TINY, [f"model.family={family}", f"data.family={family}"])
        row = measure.measure_family(family, recipe)
        assert 0.5 <= row["ratio_estimate_to_measured"] <= 2.0, row
