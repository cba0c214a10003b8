"""The `vllm` generation backend's parts that run without a GPU (vlmrun/generation/vllm.py): the
requests it sends (our token ids, images as embeddings with one placeholder each, which vLLM expands
again to exactly the ids the policy scores), the per-response seeds and their checkpointed stream,
the results read back into rollouts, and the refusals where vLLM cannot run. vLLM's own
SamplingParams and output classes through the same functions: tests/test_vllm_classes.py. The
engine itself: tools/gpu/vllm_check.py on a lent GPU."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from data_samples import make_recipe
from vlmrun_cli import ROOT

from vlmrun.config.load import load_recipe
from vlmrun.errors import InputError
from vlmrun.generation import open_generator
from vlmrun.generation.interface import SamplingParams
from vlmrun.generation.prompts import prompt_media
from vlmrun.generation.special_tokens import SpecialTokens
from vlmrun.generation.vllm import (
    VllmGenerator,
    collapse_placeholders,
    engine_requests,
    response_seed,
    rollouts_from,
    sampling_options,
)
from vlmrun.models.spec import ModelSpec

GPU_GRPO = "recipes/qwen2.5-vl-3b-clevr-grpo-1n2g.yaml"


def test_placeholder_runs_collapse_to_one_token_each():
    assert collapse_placeholders([1, 7, 7, 7, 2, 3, 7, 7, 4, 7], 7) == [1, 7, 2, 3, 7, 4, 7]
    assert collapse_placeholders([1, 2, 3], 7) == [1, 2, 3]


def test_seeds_are_per_response_and_unrelated():
    seeds = {response_seed(1234, call, s, g) for call in range(3) for s in ("a", "b") for g in range(4)}
    assert len(seeds) == 24 and all(0 <= x < 2**63 for x in seeds)
    assert response_seed(1234, 0, "a", 0) == response_seed(1234, 0, "a", 0) != response_seed(1235, 0, "a", 0)


@pytest.fixture(scope="module")
def prompts(clevr_set, tiny_dirs):
    from vlmrun.data.loader import val_batches

    recipe = make_recipe(clevr_set, family="qwen2_5_vl")
    _, batches, _ = val_batches(recipe, processor_dir=tiny_dirs["qwen2_5_vl"], samples=4, batch_size=4)
    return batches[0], SpecialTokens.of_directory(tiny_dirs["qwen2_5_vl"])


def test_a_request_is_the_prompts_ids_with_its_images_as_embeddings_vllm_expands_back(prompts):
    """vLLM's processor puts as many placeholder tokens back as an image's embeddings have rows
    (grid / merge^2): what it then runs is the unpadded prompt the policy scores."""
    batch, tokens = prompts
    image = tokens.image_token_id
    media = prompt_media(batch, image)
    embeds = [
        {"image_embeds": torch.zeros(int(m["image_grid_thw"].prod()) // 4, 8), "image_grid_thw": m["image_grid_thw"]}
        for m in media
    ]
    requests = engine_requests(batch, image, embeds)
    assert len(requests) == len(batch) and all(m for m in media)
    for i, request in enumerate(requests):
        ids = request["prompt_token_ids"]
        assert ids.count(image) == 1 and request["multi_modal_data"]["image"] is embeds[i]
        at = ids.index(image)
        expanded = ids[:at] + [image] * embeds[i]["image_embeds"].shape[0] + ids[at + 1 :]
        assert expanded == batch.input_ids[i][batch.attention_mask[i].bool()].tolist()
    text_only = engine_requests(batch, image, [None] * len(batch))
    assert all("multi_modal_data" not in r and r["prompt_token_ids"].count(image) > 1 for r in text_only)


def test_sampling_options_draw_with_the_seed_or_greedily(prompts):
    _, tokens = prompts
    ours = SamplingParams(temperature=0.8, top_p=0.95, max_new_tokens=16, seed=3)
    drawn = sampling_options(ours, 99, tokens)
    assert (drawn["temperature"], drawn["top_p"], drawn["seed"], drawn["max_tokens"]) == (0.8, 0.95, 99, 16)
    assert drawn["n"] == 1 and drawn["logprobs"] == 0 and drawn["top_k"] == 0
    assert drawn["stop_token_ids"] == list(tokens.eos_ids) and tokens.image_token_id in drawn["logit_bias"]
    greedy = sampling_options(ours, None, tokens)
    assert greedy["temperature"] == 0.0 and greedy["seed"] is None


def _output(ids, logprobs):
    entries = (
        None if logprobs is None else [{t: SimpleNamespace(logprob=lp)} for t, lp in zip(ids, logprobs, strict=True)]
    )
    return SimpleNamespace(outputs=[SimpleNamespace(token_ids=ids, logprobs=entries)])


def test_results_become_right_padded_rollouts_cut_after_the_end_of_turn(prompts):
    batch, tokens = prompts
    eos, pad = tokens.eos_ids[0], tokens.pad_token_id
    two = batch.__class__(
        batch.sample_ids[:1] * 2, batch.input_ids[:1].repeat(2, 1), batch.attention_mask[:1].repeat(2, 1), ["3", "3"]
    )
    outputs = [_output([5, eos, 9], [-0.1, -0.2, -0.3]), _output([6], [-0.4])]
    got = rollouts_from(outputs, two, n=2, tokens=tokens, generate_s=1.5)
    assert got.response_ids.tolist() == [[5, eos, pad], [6, pad, pad]]
    assert got.response_mask.tolist() == [[1, 1, 0], [1, 0, 0]]
    assert torch.equal(got.logprobs, torch.tensor([[-0.1, -0.2, 0.0], [-0.4, 0.0, 0.0]]))
    assert got.group_size == 2 and got.generate_s == 1.5 and torch.equal(got.prompt_ids, two.input_ids)
    with pytest.raises(ValueError, match="no log-prob"):
        rollouts_from([_output([5], None), _output([6], [-0.4])], two, n=2, tokens=tokens, generate_s=0.0)
    with pytest.raises(ValueError, match="answered 1 requests of 2"):
        rollouts_from(outputs[:1], two, n=2, tokens=tokens, generate_s=0.0)


def test_the_sampling_stream_is_a_call_count_a_checkpoint_keeps(tiny_dirs):
    engine = VllmGenerator(model=ModelSpec(directory=tiny_dirs["qwen2_5_vl"]), device="cuda")
    engine.load_state_dict({"seed": 1234, "calls": 7})
    assert engine.state_dict() == {"seed": 1234, "calls": 7}
    with pytest.raises(ValueError, match="another generation backend"):
        engine.load_state_dict({"seed": 1234, "generator": None})  # the hf backend's


def test_where_vllm_cannot_run_it_is_refused_naming_the_fix(tiny_dirs, monkeypatch):
    spec = ModelSpec(directory=tiny_dirs["qwen2_5_vl"])
    with pytest.raises(ValueError, match="generation.backend: hf"):
        open_generator("vllm", model=spec, device="cpu")
    for key in ("VLLM_ENABLE_V1_MULTIPROCESSING", "VLLM_USE_FLASHINFER_SAMPLER"):
        monkeypatch.delenv(key, raising=False)  # setup sets them; undone after the test
    monkeypatch.setitem(__import__("sys").modules, "vllm", None)  # not importable, as on a node without it
    with pytest.raises(RuntimeError, match="needs the vllm package on the node .* generation.backend: hf"):
        open_generator("vllm", model=spec, device="cuda").setup()


@pytest.mark.parametrize(
    "recipe, sets, field, words",
    [
        ("recipes/tiny-grpo-cpu.yaml", ["generation.backend=vllm"], "generation.backend", "needs GPUs"),
        ("recipes/omni-clevr-grpo-1n8g.yaml", ["generation.backend=vllm"], "generation.backend", "tensor parallel"),
        ("recipes/qwen2.5-vl-3b-clevr-1n2g.yaml", ["generation.backend=vllm"], "generation.backend", "GRPO's rollouts"),
        (GPU_GRPO, ["generation.vllm={enforce_eager: true}"], "generation.vllm", "generation.backend: vllm"),
        (
            GPU_GRPO,
            ["generation.backend=vllm", "generation.vllm={max_model_len: 512}"],
            "generation.vllm.max_model_len",
            "data.max_seq_len + grpo.max_new_tokens = 528",
        ),
        (
            GPU_GRPO,
            ["generation.backend=vllm", "generation.vllm={gpu_memory_utilization: 1.5}"],
            "generation.vllm.gpu_memory_utilization",
            "less than or equal to 1",
        ),
    ],
)
def test_a_recipe_vllm_cannot_run_is_refused_at_load(recipe, sets, field, words):
    with pytest.raises(InputError) as e:
        load_recipe(recipe, sets)
    assert str(e.value).startswith(field) and words in str(e.value)


def test_the_engine_options_come_from_the_recipe():
    recipe = load_recipe(GPU_GRPO, ["generation.backend=vllm", "generation.vllm={enforce_eager: true}"])
    options = recipe.generation.engine_options(max_model_len=528)
    assert options == {
        "gpu_memory_utilization": 0.5,
        "max_model_len": 528,
        "enforce_eager": True,
        "enable_prefix_caching": True,
    }
    assert load_recipe(GPU_GRPO).generation.engine_options(max_model_len=528) == {}


def test_the_memory_check_counts_the_engines_share_while_it_generates_and_nothing_while_the_policy_trains():
    from vlmrun.models.fit import check_memory_fit, device_bytes

    hf = check_memory_fit(load_recipe(GPU_GRPO)).estimate
    fit = check_memory_fit(load_recipe(GPU_GRPO, ["generation.backend=vllm"]))
    e = fit.estimate
    assert e.engine_budget == int(0.5 * device_bytes(80)) and not e.engine_resident
    assert e.phase_terms()["generation"] == {
        "generation engine": e.engine_weights,
        "generation": e.engine_budget - e.engine_weights,
    }
    assert e.phase_total("generation") == sum(e.resident_terms("generation").values()) + e.engine_budget + e.overhead
    assert {p: e.phase_total(p) for p in ("forward", "backward")} == {
        p: hf.phase_total(p) for p in ("forward", "backward")
    }
    with pytest.raises(InputError) as refused:  # a share that cannot hold the weights: the Omni's case at TP 1
        check_memory_fit(
            load_recipe(GPU_GRPO, ["generation.backend=vllm", "generation.vllm={gpu_memory_utilization: 0.05}"])
        )
    assert refused.value.field == "generation.vllm.gpu_memory_utilization" and "tensor parallel" in str(refused.value)


def test_the_gpu_check_prepares_its_model_and_prompts_here_and_refuses_without_a_gpu(tmp_path):
    """tools/gpu/vllm_check.py's preparation runs anywhere: a weightless model directory of the 3B
    layout whose tokenizer and processor make prompts the engine requests carry back exactly; the
    check itself needs a GPU and says so (exit 2)."""
    import json
    import subprocess
    import sys

    tools = str(ROOT / "tools" / "gpu")
    sys.path.insert(0, tools)
    try:
        import vllm_check
    finally:
        sys.path.remove(tools)
    directory, config = vllm_check.model_dir(tmp_path)
    assert config["text_config"]["vocab_size"] == 151936 and not list(directory.glob("*.safetensors"))
    batch = vllm_check.prompts(directory, 2)
    tokens = SpecialTokens.of_directory(directory)
    assert int((batch.input_ids[0] == tokens.image_token_id).sum()) == 256  # 448 px: 16 x 16 merged patches
    (request, _) = engine_requests(batch, tokens.image_token_id, [{"image_grid_thw": None}] * 2)
    assert request["prompt_token_ids"].count(tokens.image_token_id) == 1
    check = [sys.executable, "tools/gpu/vllm_check.py"]
    out = subprocess.run(check, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert out.returncode == 2 and json.loads(out.stdout) == {
        "ok": False,
        "error": "no CUDA device: the vllm backend runs on a GPU only",
    }
