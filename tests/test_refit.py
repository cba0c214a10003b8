"""Refit streams: the policy's weights reach a generation engine bucket by bucket, in the engine's dtype,
copied into the engine's own tensors, every weight exactly once, the same numbers as loading a whole
state dict. (Sharded policies: test_fsdp_policy.py compares the streamed weights of FSDP2 ranks with
the replicated ones bitwise; GRPO's probs_ratio == 1 runs through it in test_grpo.py.)"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from data_samples import FAMILIES

from vlmrun.algorithms.common.refit import refit
from vlmrun.config.train import TrainConfig
from vlmrun.generation import open_generator
from vlmrun.models.spec import ModelSpec
from vlmrun.policy import open_policy

TRAIN = TrainConfig(lr=1e-2, warmup_steps=0, lr_schedule="constant")


@pytest.fixture(scope="module")
def pair(tiny_dirs):
    """A random-init policy (seed 5) and a bf16 engine of the same architecture (seed 9: other weights)."""
    config = json.loads((Path(tiny_dirs["qwen2_5_vl"]) / "config.json").read_text())
    policy = open_policy("hf", model=ModelSpec(config=config, seed=5), rank=0, world_size=1, train=TRAIN)
    policy.setup(master_addr="127.0.0.1", master_port=0, max_steps=4)
    engine = open_generator("hf", model=ModelSpec(config=config, seed=9, dtype="bfloat16"))
    engine.setup()
    yield policy, engine
    policy.shutdown()
    engine.shutdown()


def test_buckets_hold_whole_tensors_up_to_the_bucket_size_each_name_once_in_the_asked_dtype(pair):
    policy, _ = pair
    names = list(policy.model.state_dict())
    limit = 64 << 10
    buckets = [dict(b) for b in policy.weights_for_refit(dtype="bfloat16", bucket_bytes=limit)]
    assert len(buckets) > 3
    streamed = [name for b in buckets for name in b]
    assert streamed == names  # every weight once, in the model's order
    for b in buckets:
        sizes = [t.numel() * t.element_size() for t in b.values()]
        assert len(b) == 1 or sum(sizes) <= limit  # a tensor larger than the bucket goes alone
        assert all(t.dtype == torch.bfloat16 for t in b.values() if t.is_floating_point())
    whole = list(policy.weights_for_refit(bucket_bytes=1 << 40))
    assert len(whole) == 1 and whole[0].keys() == set(names)


def test_a_streamed_refit_gives_the_engine_exactly_what_loading_the_whole_state_dict_does(pair):
    policy, engine = pair
    before = {n: t.clone() for n, t in engine.model.state_dict().items()}
    params = {id(p) for p in engine.model.parameters()}
    refit(engine, policy, bucket_bytes=32 << 10)
    after = engine.model.state_dict()
    assert any(not torch.equal(before[n], after[n]) for n in before)  # it changed the weights...
    assert {id(p) for p in engine.model.parameters()} == params  # ...in the engine's own tensors
    want = {n: t.to(torch.bfloat16) for n, t in policy.model.state_dict().items()}
    assert all(after[n].dtype == torch.bfloat16 and torch.equal(after[n], want[n]) for n in want)


def test_a_refit_names_a_weight_that_never_came_came_twice_is_unknown_or_has_another_shape(pair):
    policy, engine = pair
    full = {n: t for b in policy.weights_for_refit(dtype="bfloat16") for n, t in b.items()}
    first = next(iter(full))
    with pytest.raises(KeyError, match="never came"):
        engine.load_weights({n: t for n, t in full.items() if n != first})
    with pytest.raises(KeyError, match="came twice"):
        engine.load_weights([full, {first: full[first]}])
    with pytest.raises(KeyError, match="not a weight of the engine"):
        engine.load_weights([full, {"lm_head.bias": torch.zeros(1)}])
    with pytest.raises(ValueError, match=f"{first!r} has shape"):
        engine.load_weights(dict(full, **{first: full[first][:1]}))


def test_the_bucket_size_is_a_recipe_field_with_limits_outside_the_run_identity():
    from vlmrun.config.identity import IDENTITY_FIELDS
    from vlmrun.config.load import load_recipe

    tiny = Path(__file__).resolve().parents[1] / "recipes" / "tiny-clevr-cpu.yaml"
    assert load_recipe(tiny, ["generation.refit_bucket_mb=8"]).generation.refit_bucket_mb == 8
    assert load_recipe(tiny, []).generation.refit_bucket_mb == 256
    # the engine is (its sampling stream is in the checkpoint); how it is refit is not
    assert [f for f in IDENTITY_FIELDS if f.startswith("generation.")] == ["generation.backend"]


def test_released_weights_free_their_memory_refuse_to_generate_and_a_refit_brings_the_same_answers(pair, tiny_dirs):
    from transformers import AutoTokenizer

    from vlmrun.data.batch import PromptBatch
    from vlmrun.generation.interface import SamplingParams

    policy, engine = pair
    ids = torch.tensor([AutoTokenizer.from_pretrained(tiny_dirs["qwen2_5_vl"]).encode("how many cubes?")])
    prompts = PromptBatch(["p"], ids, torch.ones_like(ids), ["3"])
    greedy = SamplingParams(temperature=0, max_new_tokens=6)
    refit(engine, policy, bucket_bytes=32 << 10)
    before = engine.generate(prompts, greedy, n=1)
    tied = {id(p) for p in engine.model.parameters()}
    engine.release_weights()
    assert sum(p.numel() for p in engine.model.parameters()) == 0  # every parameter's storage is gone
    with pytest.raises(RuntimeError, match="released"):
        engine.generate(prompts, greedy, n=1)
    refit(engine, policy, bucket_bytes=32 << 10)
    assert {id(p) for p in engine.model.parameters()} == tied  # the same parameters (and ties), filled again
    after = engine.generate(prompts, greedy, n=1)
    assert torch.equal(after.response_ids, before.response_ids) and torch.equal(after.logprobs, before.logprobs)


@pytest.mark.parametrize("family", FAMILIES)
def test_an_engine_opened_for_refits_reads_no_weights_and_answers_as_one_loaded_from_disk(tiny_dirs, family):
    """`weights="refit"` (a training rank's engine): built without the directory's weights, `generate`
    refused until the first refit; then answers, log-probs and buffers (rotary frequencies) equal an
    engine loaded from the directory and refit the same way."""
    from transformers import AutoTokenizer

    from vlmrun.data.batch import PromptBatch
    from vlmrun.generation.interface import SamplingParams

    spec = ModelSpec(directory=tiny_dirs[family], dtype="bfloat16")
    policy = open_policy("hf", model=ModelSpec(directory=tiny_dirs[family], seed=5), rank=0, world_size=1, train=TRAIN)
    policy.setup(master_addr="127.0.0.1", master_port=0, max_steps=4)
    loaded, bare = open_generator("hf", model=spec), open_generator("hf", model=spec, weights="refit")
    assert bare.setup() == loaded.setup()  # the same replica, parameter count and image token
    assert sum(p.numel() for p in bare.model.parameters()) == 0  # nothing of the weights is held
    ids = torch.tensor([AutoTokenizer.from_pretrained(tiny_dirs[family]).encode("how many cubes?")])
    prompts = PromptBatch(["p"], ids, torch.ones_like(ids), ["3"])
    greedy = SamplingParams(temperature=0, max_new_tokens=6)
    with pytest.raises(RuntimeError, match="released"):
        bare.generate(prompts, greedy, n=1)
    for engine in (loaded, bare):
        refit(engine, policy, bucket_bytes=32 << 10)
    for (name, b), (_, want) in zip(bare.model.named_buffers(), loaded.model.named_buffers(), strict=True):
        assert torch.equal(b, want), name
    got, want = bare.generate(prompts, greedy, n=1), loaded.generate(prompts, greedy, n=1)
    assert torch.equal(got.response_ids, want.response_ids) and torch.equal(got.logprobs, want.logprobs)
    with pytest.raises(ValueError, match="weights='disk'.*allowed: load, refit"):
        open_generator("hf", model=spec, weights="disk")
    policy.shutdown()


def test_a_tied_weight_is_gathered_and_sent_once_and_fills_every_name_of_it(tiny_dirs):
    """The 3B layout ties its embedding and head (the largest tensor): one tensor under two names. The
    policy sends it once, under its first name; the engine's both names hold it, and sending both is
    no error (a whole state dict), sending one name twice is."""
    config = json.loads((Path(tiny_dirs["qwen2_5_vl"]) / "config.json").read_text())
    config["tie_word_embeddings"] = True
    config.setdefault("text_config", {})["tie_word_embeddings"] = True
    policy = open_policy("hf", model=ModelSpec(config=config, seed=5), rank=0, world_size=1, train=TRAIN)
    policy.setup(master_addr="127.0.0.1", master_port=0, max_steps=4)
    engine = open_generator("hf", model=ModelSpec(config=config, seed=9, dtype="bfloat16"))
    engine.setup()
    names = list(policy.model.state_dict())
    assert "lm_head.weight" in names and policy.model.lm_head.weight is policy.model.get_input_embeddings().weight
    streamed = [n for b in policy.weights_for_refit(bucket_bytes=32 << 10) for n in b]
    assert "lm_head.weight" not in streamed and sorted(streamed) == sorted(n for n in names if n != "lm_head.weight")
    refit(engine, policy, bucket_bytes=32 << 10)
    head, embed = engine.model.lm_head.weight, engine.model.get_input_embeddings().weight
    assert head is embed and torch.equal(head, policy.model.lm_head.weight.detach().to(torch.bfloat16))
    engine.load_weights(policy.model.state_dict())  # both names: the second finds it filled
    with pytest.raises(KeyError, match="came twice"):
        engine.load_weights([{"lm_head.weight": head.detach().clone()}, {"lm_head.weight": head.detach().clone()}])
    policy.shutdown()


def _gather_rank(rank, port, out):
    """Rank `rank` of 2: sharded tensors of uneven, empty-shard and 1-D shapes on a 1-D mesh and on a 2-D
    mesh (replicas x shards, as HSDP), each made whole in bf16 by the refit stream, a row per all-gather,
    through one set of working buffers (as a refit's tensors share them: a shard's padding rows carry the
    tensor before's values)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    from vlmrun.policy import refit_stream

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    gathered = {}
    scratch = refit_stream.Scratch()
    for mesh, placements in (
        (init_device_mesh("cpu", (2,)), [Shard(0)]),
        (init_device_mesh("cpu", (1, 2)), [Replicate(), Shard(0)]),
    ):
        for shape in ((7, 3), (1, 5), (5,), (4, 2, 2)):
            torch.manual_seed(sum(shape))
            full = torch.randn(shape)
            t = distribute_tensor(full, mesh, placements)
            assert refit_stream.gather_rows(t, torch.bfloat16, mesh.ndim - 1, 1) is not None, (shape, mesh)
            # slices of one row per all-gather: every seam crossed
            got = refit_stream.whole(t, torch.bfloat16, 1, scratch=scratch)
            gathered[f"{mesh.ndim}d{shape}"] = (got, full.to(torch.bfloat16))
            into = torch.full(shape, 7.0, dtype=torch.bfloat16)  # an engine's own tensor, written in place
            assert refit_stream.whole(t, torch.bfloat16, 1, out=into, scratch=scratch) is into
            gathered[f"into {mesh.ndim}d{shape}"] = (into, full.to(torch.bfloat16))
    if rank == 0:
        torch.save(gathered, out)
    dist.destroy_process_group()


@pytest.mark.slow
def test_a_sharded_tensor_is_cast_on_its_shard_and_gathered_whole_slice_by_slice(tmp_path):
    from data_samples import free_port, start_ranks

    out = tmp_path / "gathered.pt"
    start_ranks(_gather_rank, (free_port(), str(out)))
    gathered = torch.load(out)
    assert len(gathered) == 16
    for key, (got, want) in gathered.items():
        assert got.dtype == torch.bfloat16 and torch.equal(got, want), key
