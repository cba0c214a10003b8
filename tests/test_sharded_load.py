"""The sharded load (vlmrun/models/sharded_load.py): each rank reads only its own rows of the weights.

The reader against safetensors' own files (dtypes converted, staged in small chunks, a truncated file
named); the load plan of both tiny families (Nemotron-Omni's fused experts and split qkv included);
and through the product's policy, FSDP2 over 2 gloo ranks whose sharded load gives, gathered, exactly
the tensors `from_pretrained` loads, rotary buffers included, and job.json's `policy_load` words.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from data_samples import FAMILIES, start_ranks


def test_the_private_api_it_relies_on():
    """transformers 5.24's conversion mapping and torch's shard offsets: an upgrade that moves them fails here."""
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import Chunk, MergeModulelist, WeightConverter, rename_source_key

    assert callable(get_model_conversion_mapping) and callable(rename_source_key)
    assert callable(compute_local_shape_and_global_offset)
    conv = WeightConverter("experts.*.w", "experts.w", operations=[MergeModulelist(dim=0)])
    assert conv.source_patterns and conv.target_patterns and conv.operations[0].dim == 0
    assert Chunk(dim=0).dim == 0 and getattr(Chunk(dim=0), "num_shards_attribute", None) is None


def test_rows_read_from_a_safetensors_file_equal_its_slices(tmp_path):
    from safetensors.torch import save_file

    from vlmrun.models.sharded_load import read_rows, safetensors_index

    g = torch.Generator().manual_seed(0)
    tensors = {
        "a": torch.randn(37, 5, generator=g),
        "b": torch.randn(11, 3, 2, generator=g).to(torch.bfloat16),
        "c": torch.tensor(3.5),
        "d": torch.arange(9, dtype=torch.int64),
    }
    save_file(tensors, tmp_path / "model.safetensors")
    files = safetensors_index(tmp_path)
    assert {k: (v.dtype, v.shape) for k, v in files.items()} == {
        k: (t.dtype, tuple(t.shape)) for k, t in tensors.items()
    }
    for first, stop in [(0, 37), (5, 19), (36, 37)]:  # same dtype: straight into the output
        out = torch.empty(stop - first, 5)
        read_rows(files["a"], first, out)
        assert torch.equal(out, tensors["a"][first:stop])
    out = torch.empty(7, 3, 2)  # bf16 on disk into fp32, staged two rows at a time
    read_rows(files["b"], 4, out, chunk_bytes=2 * 3 * 2 * 2)
    assert torch.equal(out, tensors["b"][4:11].float())
    out = torch.empty(4, 5, dtype=torch.bfloat16)  # fp32 on disk into bf16: rounded as .to() rounds
    read_rows(files["a"], 30, out, chunk_bytes=1)
    assert torch.equal(out, tensors["a"][30:34].to(torch.bfloat16))
    scalar, ints = torch.empty(()), torch.empty(4, dtype=torch.int64)
    read_rows(files["c"], 0, scalar)
    read_rows(files["d"], 5, ints)
    assert scalar.item() == 3.5 and ints.tolist() == [5, 6, 7, 8]

    data = (tmp_path / "model.safetensors").read_bytes()
    (tmp_path / "model.safetensors").write_bytes(data[: files["a"].start + 40])  # cut inside "a"
    with pytest.raises(OSError, match="model.safetensors: ended .* early inside a tensor"):
        read_rows(files["a"], 0, torch.empty(37, 5))


def test_a_directory_without_safetensors_has_no_plan(tmp_path, tiny_dirs):
    from transformers import AutoConfig, AutoModelForImageTextToText

    from vlmrun.models.sharded_load import plan_load

    with torch.device("meta"):
        model = AutoModelForImageTextToText.from_config(AutoConfig.from_pretrained(tiny_dirs["qwen2_5_vl"]))
    plan, why = plan_load(model, tmp_path)
    assert plan is None and why == f"{tmp_path} holds no safetensors weights this reader knows"


@pytest.mark.parametrize("family", FAMILIES)
def test_the_plan_places_every_tensor_of_the_model(tiny_dirs, family):
    from transformers import AutoConfig, AutoModelForImageTextToText

    from vlmrun.models.sharded_load import plan_load

    with torch.device("meta"):
        model = AutoModelForImageTextToText.from_config(AutoConfig.from_pretrained(tiny_dirs[family]))
    plan, why = plan_load(model, tiny_dirs[family])
    assert plan is not None, why
    names = {n for n, _ in model.named_parameters(remove_duplicate=False)} | set(model.state_dict())
    assert {n for n in names if any(a in plan.sources for a in [n])} <= names
    assert all(n in plan.sources for n, _ in model.named_parameters())  # each parameter under its first name
    used = {k for s in plan.sources.values() for k in s.keys}
    assert used == set(plan.files)  # every tensor of the files is read by some model tensor
    if family == "nemotron_omni":  # experts: one file tensor each, one fused parameter; qkv: three parameters
        fused = [s for s in plan.sources.values() if s.fused]
        chunks = [s for s in plan.sources.values() if s.chunks == 3]
        assert fused and all(len(s.keys) == 4 for s in fused)
        assert chunks and sorted({s.offset // (plan.files[s.keys[0]].shape[0] // 3) for s in chunks}) == [0, 1, 2]


def _rank_main(rank, world, recipe, model_dir, port, out):
    from data_samples import rank_policy

    torch.set_num_threads(1)
    policy, info = rank_policy(recipe, rank, world, model_dir, {"fsdp": True}, port, max_steps=2)
    full = {}
    for name, t in policy.model.state_dict().items():  # every rank joins each gather
        full[name] = t.full_tensor() if hasattr(t, "full_tensor") else t
    buffers = {n: b.clone() for n, b in policy.model.named_buffers()}
    local = {n: p.to_local().shape[0] if p.dim() else 0 for n, p in policy.model.named_parameters()}
    torch.save({"info": info, "state": full, "buffers": buffers, "local_rows": local}, f"{out}.{rank}")
    policy.shutdown()
    os._exit(0)  # skip interpreter teardown: gloo's threads sometimes abort in C++ destructors at exit


@pytest.mark.slow
@pytest.mark.parametrize("family", FAMILIES)
def test_fsdp_ranks_read_their_rows_and_hold_what_from_pretrained_loads(tmp_path, clevr_set, tiny_dirs, family):
    from data_samples import free_port, make_recipe
    from transformers import AutoModelForImageTextToText

    recipe = make_recipe(clevr_set, family=family)
    out = tmp_path / "state"
    start_ranks(_rank_main, (2, recipe, tiny_dirs[family], free_port(), str(out)))
    got = [torch.load(f"{out}.{r}", weights_only=False) for r in range(2)]
    want = AutoModelForImageTextToText.from_pretrained(tiny_dirs[family], dtype=torch.float32)
    assert got[0]["info"]["load"] == "each rank read only its own rows of the weights' files"
    state = got[0]["state"]
    assert state.keys() == want.state_dict().keys()
    for name, t in want.state_dict().items():
        assert torch.equal(state[name], t), name
    for name, b in want.named_buffers():  # the buffers no file holds (rotary frequencies) computed as at load
        assert torch.equal(got[0]["buffers"][name], b), name
    # each rank holds half the rows of a parameter (the second rank the rest)
    shape = dict(want.named_parameters())
    for name, rows in got[0]["local_rows"].items():
        if shape[name].dim():
            assert rows + got[1]["local_rows"][name] == shape[name].shape[0], name
            assert rows == -(-shape[name].shape[0] // 2), name


def _resume_rank_main(rank, world, recipe, model_dir, unread_dir, folder, ports, batches, out):
    """A trained policy saves, then takes one more step; a resumed one (no weights read from its
    directory) restores the weights, then the optimizer part while its step's forward runs: the read of
    that part starts only once the forward has begun, and the step must wait for it."""
    import threading

    import torch.distributed as dist
    from data_samples import rank_policy

    from vlmrun.checkpoint.manifest import Manifest
    from vlmrun.checkpoint.parts import MODEL_PART, OPTIMIZER_PART, PolicyState
    from vlmrun.checkpoint.read import Checkpoint
    from vlmrun.checkpoint.write import PendingCheckpoint
    from vlmrun.models.spec import ModelSpec
    from vlmrun.policy import open_policy

    torch.set_num_threads(1)
    first, then = batches[rank::world][:1], batches[rank::world][1:2]
    trained, _ = rank_policy(recipe, rank, world, model_dir, {"fsdp": True}, ports[0], max_steps=4)
    trained.train_step(first)  # AdamW's moments and the schedule move
    with torch.no_grad():  # weights no file of the model directory holds
        for p in trained.model.parameters():
            p.add_(0.5)
    files = PendingCheckpoint(1, folder).write_policy(trained.checkpoint_state(), rank=rank)
    want = {n: t.full_tensor() for n, t in trained.model.state_dict().items()}
    step = trained.train_step(then)
    after = {n: t.full_tensor() for n, t in trained.model.state_dict().items()}
    trained.shutdown()
    resumed = open_policy(
        "hf",
        model=ModelSpec(directory=unread_dir, dtype=recipe.model.dtype),
        rank=rank,
        world_size=world,
        train=recipe.train,
        parallel=recipe.parallel.model_copy(update={"dp": world, "fsdp": True}),
    )
    info = resumed.setup(master_addr="127.0.0.1", master_port=ports[1], max_steps=4, weights="checkpoint")
    names = [None] * world
    dist.all_gather_object(names, files)
    found = Checkpoint(1, Path(folder), Manifest(4, 1, {n: d for f in names for n, d in f.items()}))
    state = resumed.checkpoint_state()
    resumed.load_checkpoint_state(found.read_policy(PolicyState(state.storage, {MODEL_PART: state.parts[MODEL_PART]})))
    got = {n: t.full_tensor() for n, t in resumed.model.state_dict().items()}
    buffers = {n: b.clone() for n, b in resumed.model.named_buffers()}
    forward, group = threading.Event(), dist.new_group(backend="gloo")
    resumed.model.register_forward_pre_hook(lambda *_: forward.set())

    def read_once_the_forward_began():
        if not forward.wait(60):
            raise TimeoutError("the step waited for the optimizer part before its forward")
        return found.read_policy(PolicyState(state.storage, {OPTIMIZER_PART: state.parts[OPTIMIZER_PART]}), group)

    resumed.load_checkpoint_state_later(read_once_the_forward_began)
    again = resumed.train_step(then)
    got_after = {n: t.full_tensor() for n, t in resumed.model.state_dict().items()}
    rows = [(r.loss, r.grad_norm, r.lr) for r in (step, again)]
    torch.save({"info": info, "got": got, "want": want, "buffers": buffers, "rows": rows}, f"{out}.{rank}")
    torch.save({"after": after, "got_after": got_after}, f"{out}.after.{rank}")
    resumed.shutdown()
    os._exit(0)


@pytest.mark.slow
def test_a_resumed_policy_reads_no_weights_of_its_model_directory_and_its_optimizer_during_the_step(
    tmp_path, clevr_set, tiny_dirs
):
    """A resume's ranks allocate the model unread and the checkpoint fills every tensor (the weights'
    files here are gone: only config, tokenizer and processor remain); the optimizer part arrives while
    the first step's forward and backward run, and that step equals the uninterrupted policy's."""
    import shutil

    from data_samples import free_port, make_recipe
    from transformers import AutoModelForImageTextToText

    from vlmrun.data.loader import val_batches

    unread = tmp_path / "model"
    shutil.copytree(tiny_dirs["qwen2_5_vl"], unread, ignore=shutil.ignore_patterns("*.safetensors"))
    out, folder = tmp_path / "state", tmp_path / "checkpoint"
    recipe = make_recipe(clevr_set)
    batches, _, _ = val_batches(recipe, processor_dir=tiny_dirs["qwen2_5_vl"], samples=8, batch_size=2)
    ports = (free_port(), free_port())
    args = (2, recipe, tiny_dirs["qwen2_5_vl"], str(unread), str(folder), ports, batches, str(out))
    start_ranks(_resume_rank_main, args)
    got = torch.load(f"{out}.0", weights_only=False)
    assert got["info"]["load"] == "from the checkpoint it resumed (the model's own weights not read)"
    assert got["got"].keys() == got["want"].keys()
    for name, t in got["want"].items():
        assert torch.equal(got["got"][name], t), name
    original = AutoModelForImageTextToText.from_pretrained(tiny_dirs["qwen2_5_vl"], dtype=torch.float32)
    for name, b in original.named_buffers():  # the buffers no checkpoint holds, computed (rotary frequencies)
        assert torch.equal(got["buffers"][name], b), name
    step, again = got["rows"]
    assert again == step  # loss, gradient norm and the LR the restored schedule gave, bit for bit
    weights = torch.load(f"{out}.after.0", weights_only=False)
    for name, t in weights["after"].items():
        assert torch.equal(weights["got_after"][name], t), name


def test_the_model_on_disk_is_found_by_name(tiny_dirs):
    """The tiny families save under other names than the model's (the reason for the plan)."""
    from vlmrun.models.sharded_load import safetensors_index

    disk = set(safetensors_index(Path(tiny_dirs["qwen2_5_vl"])))
    assert any(k.startswith("model.layers.0.") for k in disk)
    assert not any(k.startswith("model.language_model.") for k in disk)
