"""The megatron backend's logic in-process, without megatron-core: the HF <-> megatron mapping both ways,
the mask, the gradient norm's arithmetic, the CPU shims' device remap, the capability spec and layout
refusals at submit, the worker group's roles and collection, the RNG a relayout takes, the fit check's
tp / pp terms, and that the submit path never imports megatron-core. (Spawned ranks and real runs:
tests/test_megatron_policy.py, tests/test_megatron_runs.py.)"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from vlmrun_cli import TINY

from vlmrun.config.layout import RankLayout
from vlmrun.config.load import load_recipe
from vlmrun.errors import InputError
from vlmrun.policy.megatron.mapping import LmShape, ParamMap, hf_names, piece, stage_params, stage_plan, whole

SHAPE = LmShape(layers=4, hidden=16, heads=4, kv_heads=2, head_dim=4, ffn=24, vocab=32, tied=False)


def _hf_tensors(shape: LmShape, names: list[str]) -> dict[str, torch.Tensor]:
    """Random HF tensors of `shape`'s language model, by name (what the mapping reads)."""
    g = torch.Generator().manual_seed(0)
    q, kv, h, f = shape.heads * shape.head_dim, shape.kv_heads * shape.head_dim, shape.hidden, shape.ffn
    shapes = {
        "q_proj.weight": (q, h),
        "q_proj.bias": (q,),
        "k_proj.weight": (kv, h),
        "k_proj.bias": (kv,),
        "v_proj.weight": (kv, h),
        "v_proj.bias": (kv,),
        "o_proj.weight": (h, q),
        "gate_proj.weight": (f, h),
        "up_proj.weight": (f, h),
        "down_proj.weight": (h, f),
        "layernorm.weight": (h,),
        "embed_tokens.weight": (shape.vocab, h),
        "norm.weight": (h,),
        "lm_head.weight": (shape.vocab, h),
    }
    out = {}
    for name in names:
        key = next(k for k in shapes if name.endswith(k))
        out[name] = torch.randn(shapes[key], generator=g)
    return out


@pytest.mark.parametrize("tp", [1, 2])
def test_every_megatron_parameter_round_trips_through_its_hf_pieces(tp):
    tensors = _hf_tensors(SHAPE, hf_names(SHAPE, []))
    for pp in (1, 2):
        for s in range(pp):
            for m in stage_params(SHAPE, stage_plan(SHAPE, s, pp), []):
                for r in range(tp):
                    pieces = {n: piece(tensors[n], m.split, r, tp) for n in m.hf}
                    local = m.from_hf(pieces)
                    back = m.to_hf(local)
                    assert all(torch.equal(back[n], pieces[n]) for n in m.hf), m.mcore


def test_transformer_engines_spec_holds_the_norms_in_its_linears_and_the_same_hf_tensors():
    plan = stage_plan(SHAPE, 0, 1)
    local, fused = stage_params(SHAPE, plan, []), stage_params(SHAPE, plan, [], fused_norms=True)
    assert [m.hf for m in local] == [m.hf for m in fused]
    names = {m.mcore for m in fused}
    assert "lm.decoder.layers.0.self_attention.linear_qkv.layer_norm_weight" in names
    assert "lm.decoder.layers.0.mlp.linear_fc1.layer_norm_weight" in names
    assert not any("input_layernorm" in n or "pre_mlp_layernorm" in n for n in names)


def test_fused_qkv_is_group_major_and_each_tp_rank_holds_whole_groups():
    qkv = ParamMap(mcore="qkv", hf=("q", "k", "v"), kind="qkv", split=0, q_per_group=2, head_dim=1)
    q, k, v = torch.arange(4.0), torch.tensor([10.0, 11.0]), torch.tensor([20.0, 21.0])  # 4 q heads, 2 groups
    assert qkv.from_hf({"q": q, "k": k, "v": v}).tolist() == [0, 1, 10, 20, 2, 3, 11, 21]
    rank1 = qkv.from_hf({n: piece(t, 0, 1, 2) for n, t in {"q": q, "k": k, "v": v}.items()})
    assert rank1.tolist() == [2, 3, 11, 21]  # the second group alone
    up = ParamMap(mcore="fc1", hf=("g", "u"), kind="gate_up", split=0)
    assert up.from_hf({"g": torch.tensor([1.0, 2.0]), "u": torch.tensor([3.0, 4.0])}).tolist() == [1, 2, 3, 4]
    assert torch.equal(whole([torch.ones(2, 1), torch.zeros(2, 1)], 1), torch.tensor([[1.0, 0.0], [1.0, 0.0]]))


@pytest.mark.parametrize("tied", [False, True])
@pytest.mark.parametrize("pp", [1, 2, 4])
def test_the_stages_hold_every_hf_tensor_once_and_a_tied_head_as_a_copy(pp, tied):
    shape = LmShape(**{**SHAPE.__dict__, "tied": tied})
    held = []
    for s in range(pp):
        maps = stage_params(shape, stage_plan(shape, s, pp), ["blocks.0.w"])
        held += [n for m in maps if not m.copy for n in m.hf]
        copies = [m for m in maps if m.copy]
        assert copies == ([m for m in maps if m.mcore == "lm.output_layer.weight"] if tied and s == pp - 1 else [])
    assert sorted(held) == sorted(hf_names(shape, ["blocks.0.w"]))
    assert len(held) == len(set(held))
    with pytest.raises(ValueError, match="do not split into 3 equal pipeline stages"):
        stage_plan(shape, 0, 3)


@pytest.mark.parametrize("family", ["qwen2_vl", "qwen2_5_vl"])
def test_the_mapping_names_every_tensor_of_the_hf_model_and_nothing_else(family):
    from vlmrun.models.architecture import REFERENCE_DIR
    from vlmrun.models.build import build_model
    from vlmrun.models.spec import ModelSpec

    config = json.loads((REFERENCE_DIR / f"tiny_{family}.json").read_text())
    model = build_model(ModelSpec(config=config), on_meta=True)
    visual = [n for n, _ in model.model.visual.named_parameters()]
    assert hf_names(LmShape.of(model.config), visual) == list(model.state_dict())


def test_the_mask_is_causal_hides_padding_and_keeps_a_packed_sequence_to_itself():
    from vlmrun.policy.megatron.model import attention_mask

    padded = attention_mask(torch.tensor([[1, 1, 1, 0]]))[0, 0]
    assert padded[2].tolist() == [False, False, False, True]  # a token sees itself and the past, not padding
    assert padded[0].tolist() == [False, True, True, True]  # causal
    assert padded[3].all()  # a padding query sees nothing (megatron fills -10000: a uniform row, no NaN)
    packed = attention_mask(torch.tensor([[1, 1, 2, 2, 0]]))[0, 0]
    assert packed[3].tolist() == [True, True, False, False, True]  # the second sequence sees itself only


def test_the_gradient_norm_counts_a_replicated_parameter_once_and_never_the_tied_copy():
    from vlmrun.policy.megatron.grads import GradGroups, grad_norm, sync_gradients

    split, replicated, copy = (torch.nn.Parameter(torch.zeros(2)) for _ in range(3))
    split.vlmrun_tp_split, copy.vlmrun_tied_copy = True, True
    for p, g in ((split, [3.0, 0.0]), (replicated, [4.0, 0.0]), (copy, [100.0, 0.0])):
        p.grad = torch.tensor(g)
    alone = GradGroups(tp=None, dp=None, model_parallel=None, embedding=None, tp_rank=0)
    assert grad_norm([split, replicated, copy], alone) == 5.0  # the copy is the embedding's: not counted
    second = GradGroups(tp=None, dp=None, model_parallel=None, embedding=None, tp_rank=1)
    assert grad_norm([split, replicated], second) == 3.0  # tp rank 1: its shard only, the replica on rank 0
    embedding, output = torch.nn.Parameter(torch.zeros(1)), torch.nn.Parameter(torch.zeros(1))
    embedding.grad, output.grad = torch.tensor([1.0]), torch.tensor([2.0])
    sync_gradients([embedding, output], (embedding, output), alone)  # one stage holds both: summed here
    assert embedding.grad.item() == output.grad.item() == 3.0


def test_the_schedules_cuda_token_counter_goes_to_the_cpu_and_nothing_else_changes():
    from vlmrun.policy.megatron.cpu_shims import _CpuFactories

    shimmed = _CpuFactories(torch)
    assert shimmed.zeros([], dtype=torch.int, device="cuda").device.type == "cpu"
    assert shimmed.ones(2, device="cpu").device.type == "cpu" and shimmed.float32 is torch.float32


@pytest.mark.parametrize(
    "settings, field, words",
    [
        (["parallel.tp=2", "parallel.dp=1"], "parallel.tp", "model.backend hf runs parallel.tp 1"),
        (["parallel.pp=2", "parallel.dp=1"], "parallel.pp", "(pp > 1: megatron)"),
        (["model.backend=megatron", "parallel.ep=2"], "parallel.ep", "no experts to spread"),
        (["model.backend=megatron", "model.family=nemotron_omni"], "model.backend", "Mamba"),
        (["model.backend=megatron", "model.family=qwen3_vl"], "model.backend", "deepstack"),
        (["model.backend=megatron", "parallel.fsdp=true"], "parallel.fsdp", "not FSDP2"),
        (["model.backend=megatron", "parallel.sequence_parallel=true"], "parallel.sequence_parallel", "tp > 1"),
        (["parallel.sequence_parallel=true"], "parallel.sequence_parallel", "model.backend: megatron"),
    ],
)
def test_a_backend_refuses_at_submit_what_it_cannot_run_naming_the_field(settings, field, words):
    with pytest.raises(InputError) as e:
        load_recipe(TINY, settings)
    assert e.value.field == field and words in str(e.value), str(e.value)


def test_megatron_takes_the_layout_and_its_default_is_no_fsdp_even_on_gpus():
    r = load_recipe(
        TINY, ["model.backend=megatron", "parallel.tp=2", "parallel.pp=2", "parallel.dp=1", "cluster.cpus_per_node=4"]
    )
    assert r.parallel.layout.world_size == 4 and r.parallel.fsdp is False
    gpu = ["cluster.gpus_per_node=4", "cluster.cpus_per_node=8", "model.backend=megatron", "parallel.dp=2"]
    assert load_recipe(TINY, [*gpu, "parallel.tp=2"]).parallel.fsdp is False
    assert load_recipe(TINY, ["cluster.gpus_per_node=2", "cluster.cpus_per_node=8"]).parallel.fsdp is True


@pytest.mark.parametrize(
    "settings, field, words",
    [
        (["parallel.tp=4"], "parallel.tp", "must divide the model's 2 key/value heads"),
        (["parallel.tp=3"], "parallel.tp", "must divide the model's 4 attention heads"),
        (["parallel.pp=3"], "parallel.pp", "must divide the model's 2 decoder layers"),
    ],
)
def test_a_layout_the_model_cannot_be_cut_into_is_refused_at_submit(settings, field, words):
    from vlmrun.models.fit import check_memory_fit

    recipe = load_recipe(TINY, ["model.backend=megatron", "parallel.dp=1", "cluster.cpus_per_node=4", *settings])
    with pytest.raises(InputError) as e:
        check_memory_fit(recipe)
    assert e.value.field == field and words in str(e.value), str(e.value)


def test_the_fit_check_divides_the_state_by_tp_and_keeps_1f1b_micro_batches_in_flight():
    from vlmrun.models.architecture import load_architecture
    from vlmrun.models.fit import training_shape
    from vlmrun.models.memory_layout import estimate

    base = ["model.backend=megatron", "model.tiny=false", "model.path=/nowhere", "model.reference_config=qwen2_5_vl_3b"]
    base += ["cluster.gpus_per_node=8", "cluster.cpus_per_node=64", "train.global_batch_size=64"]
    arch = load_architecture(load_recipe(TINY, [*base, "parallel.dp=8"]).model).architecture

    def peak(*layout):
        return estimate(arch, training_shape(load_recipe(TINY, [*base, *layout]))[0])

    whole, halves = peak("parallel.dp=8"), peak("parallel.dp=4", "parallel.tp=2")
    vision, copy = arch.vision.params, arch.vocab * arch.hidden if arch.tied else 0  # the 3B ties its head
    assert halves.weights < whole.weights and halves.weights == pytest.approx(
        (vision + (arch.total - vision + copy) / 2) * 4, rel=1e-3
    )
    staged = peak("parallel.dp=4", "parallel.pp=2")
    assert staged.stage == 0 and staged.weights < whole.weights
    per_micro = peak("parallel.dp=8", "parallel.pp=1").activations / 1  # one micro-batch in flight at pp=1
    assert staged.activations == pytest.approx(2 * per_micro / 2, rel=0.05)  # 2 in flight, half the layers


def test_the_fit_refusal_names_the_layout_change_that_lowers_the_peak():
    from vlmrun.models.fit import check_memory_fit

    recipe = load_recipe(
        "recipes/qwen2.5-vl-3b-clevr-megatron-1n8g.yaml",
        ["parallel.tp=1", "parallel.dp=8", "parallel.sequence_parallel=false", "cluster.gpu_memory_gb=80"],
    )
    with pytest.raises(InputError) as e:
        check_memory_fit(recipe)
    assert e.value.field == "cluster.gpu_memory_gb" and "parallel.tp=2 with parallel.dp=4" in str(e.value)
    fit = check_memory_fit(load_recipe("recipes/qwen2.5-vl-3b-clevr-megatron-1n8g.yaml", []))
    assert fit.estimate.stage == 0 and "pipeline stage 0 of 1" in fit.assumption


def test_collect_takes_each_replicas_owner_or_result_rank():
    from vlmrun.distributed.topology import Role, plan_placement
    from vlmrun.distributed.worker_group import WorkerGroup

    plan = plan_placement(RankLayout(dp=2, tp=2, pp=2))
    group = object.__new__(WorkerGroup)
    group.plan, group.workers = plan, [None] * 8
    assert [s.delivery_ranks for s in plan.shards] == [(0, 1, 4, 5), (2, 3, 6, 7)]
    assert group.collect(list(range(8)), Role.OWNER) == [0, 2]
    assert group.collect(list(range(8)), Role.RESULT) == [4, 6]
    assert plan.loader_hash == plan_placement(RankLayout(dp=2)).placement_hash != plan.placement_hash


def test_a_relayout_gives_each_rank_its_replica_owners_rng():
    from vlmrun.distributed.topology import rng_source

    now = RankLayout(dp=2, pp=2)
    assert rng_source(now, {"parallel.tp": 1, "parallel.pp": 2}) is None  # the layout that wrote it
    source = rng_source(now, {"parallel.tp": 2, "parallel.pp": 1})  # written at dp=2 x tp=2
    assert [source(r) for r in range(4)] == [0, 2, 0, 2]


def test_submit_dry_run_of_a_megatron_recipe_imports_no_megatron_core(tmp_path):
    probe = (
        "import sys, json; from pathlib import Path; from vlmrun.launch.submit import submit_run; "
        f"submit_run(Path({str(TINY)!r}), ['model.backend=megatron', 'parallel.tp=2', 'parallel.dp=1'], cluster='local', "
        f"dry_run=True, run_dir=Path({str(tmp_path / 'r')!r})); print(json.dumps('megatron.core' in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert json.loads(out.stdout.strip().splitlines()[-1]) is False
