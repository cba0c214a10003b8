"""The `vllm` generation backend's logic on either side of the process boundary, without the engine
(vlmrun/generation/vllm.py, vllm_engine.py): the prompts a rank sends (our token ids, each image's pixel
rows once, one placeholder each, which vLLM expands again to exactly the ids the policy scores), the
per-response seeds and their checkpointed stream, the draws read back into rollouts, and the order of
what a rank asks of an engine that sleeps (a GPU's): its own cached blocks go back to the device before
every wake, the KV cache wakes only to generate, a release resets both multimodal caches before the
sleep. The real engine: tests/test_vllm_lane_engine.py; where it may run: tests/test_vllm_env.py."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from data_samples import make_recipe

from vlmrun.generation import open_generator
from vlmrun.generation import vllm as backend
from vlmrun.generation.interface import SamplingParams
from vlmrun.generation.prompts import prompt_media
from vlmrun.generation.special_tokens import SpecialTokens
from vlmrun.generation.vllm import VllmGenerator
from vlmrun.generation.vllm_engine import EngineGates, VllmEngine
from vlmrun.generation.vllm_requests import (
    collapse_placeholders,
    engine_prompts,
    response_seed,
    rollouts_from,
    sampling_options,
)
from vlmrun.models.spec import ModelSpec


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


def test_an_engine_prompt_is_the_prompts_ids_with_its_own_pixel_rows_vllm_expands_back(prompts):
    """vLLM's processor puts as many placeholder tokens back as an image's embeddings have rows
    (grid / merge^2): what it then runs is the unpadded prompt the policy scores."""
    batch, tokens = prompts
    image = tokens.image_token_id
    media = prompt_media(batch, image)
    sent = engine_prompts(batch, image)
    assert len(sent) == len(batch) and all(m for m in media)
    for i, prompt in enumerate(sent):
        ids = prompt["ids"]
        assert ids.count(image) == 1 and prompt["grid"] == media[i]["image_grid_thw"].tolist()
        assert torch.equal(torch.from_numpy(prompt["pixels"]), media[i]["pixel_values"].float())
        at = ids.index(image)
        expanded = ids[:at] + [image] * (int(media[i]["image_grid_thw"].prod()) // 4) + ids[at + 1 :]
        assert expanded == batch.input_ids[i][batch.attention_mask[i].bool()].tolist()
    text_only = engine_prompts(
        batch.__class__(batch.sample_ids, batch.input_ids, batch.attention_mask, batch.answers), image
    )
    assert all(set(p) == {"ids"} and p["ids"].count(image) > 1 for p in text_only)


def test_sampling_options_draw_with_the_seed_or_greedily(prompts):
    _, tokens = prompts
    ours = SamplingParams(temperature=0.8, top_p=0.95, max_new_tokens=16, seed=3)
    drawn = sampling_options(ours, 99, tokens)
    assert (drawn["temperature"], drawn["top_p"], drawn["seed"], drawn["max_tokens"]) == (0.8, 0.95, 99, 16)
    assert drawn["n"] == 1 and drawn["logprobs"] == 0 and drawn["top_k"] == 0
    assert drawn["stop_token_ids"] == list(tokens.eos_ids) and tokens.image_token_id in drawn["logit_bias"]
    greedy = sampling_options(ours, None, tokens)
    assert greedy["temperature"] == 0.0 and greedy["seed"] is None


def test_draws_become_right_padded_rollouts_cut_after_the_end_of_turn(prompts):
    batch, tokens = prompts
    eos, pad = tokens.eos_ids[0], tokens.pad_token_id
    two = batch.__class__(
        batch.sample_ids[:1] * 2, batch.input_ids[:1].repeat(2, 1), batch.attention_mask[:1].repeat(2, 1), ["3", "3"]
    )
    drawn = [([5, eos, 9], [-0.1, -0.2, -0.3]), ([6], [-0.4])]
    got = rollouts_from(drawn, two, n=2, tokens=tokens, generate_s=1.5)
    assert got.response_ids.tolist() == [[5, eos, pad], [6, pad, pad]]
    assert got.response_mask.tolist() == [[1, 1, 0], [1, 0, 0]]
    assert torch.equal(got.logprobs, torch.tensor([[-0.1, -0.2, 0.0], [-0.4, 0.0, 0.0]]))
    assert got.group_size == 2 and got.generate_s == 1.5 and torch.equal(got.prompt_ids, two.input_ids)
    with pytest.raises(ValueError, match="no log-prob"):
        rollouts_from([([5], []), ([6], [-0.4])], two, n=2, tokens=tokens, generate_s=0.0)
    with pytest.raises(ValueError, match="answered 1 requests of 2"):
        rollouts_from(drawn[:1], two, n=2, tokens=tokens, generate_s=0.0)


def test_the_sampling_stream_is_a_call_count_a_checkpoint_keeps(tiny_dirs):
    engine = VllmGenerator(model=ModelSpec(directory=tiny_dirs["qwen2_5_vl"]), device="cpu")
    engine.load_state_dict({"seed": 1234, "calls": 7})
    assert engine.state_dict() == {"seed": 1234, "calls": 7}
    with pytest.raises(ValueError, match="another generation backend"):
        engine.load_state_dict({"seed": 1234, "generator": None})  # the hf backend's


def test_the_engine_starts_only_beside_a_running_ray(tiny_dirs):
    import ray

    if ray.is_initialized():
        pytest.skip("Ray runs in this test process already")
    engine = open_generator("vllm", model=ModelSpec(directory=tiny_dirs["qwen2_5_vl"]), device="cpu")
    with pytest.raises(RuntimeError, match="Ray actor: start Ray in this process first"):
        engine.setup()


# ---------------------------------------------------------------- what a rank asks of a sleeping engine


class Recorder:
    """A rank's VllmGenerator with its engine process replaced by a log of the calls it gets."""

    def __init__(self, monkeypatch, tokens, *, sleep_mode: bool, end_on_release: bool = False):
        self.log: list = []
        eos = tokens.eos_ids[0]

        def call(generator, method, *args, timeout=None):
            self.log.append(method if method != "wake" else f"wake {args[0][0]}")
            if method == "generate":
                return [([5, eos], [-0.1, -0.2]) for _ in args[1]]
            return None

        def start(generator):
            self.log.append("start")
            generator._actor = object()
            generator.info = {"params": 1, "pid": None, "gates": {"sleep_mode": sleep_mode}}

        monkeypatch.setattr(VllmGenerator, "_call", call)
        monkeypatch.setattr(VllmGenerator, "_start_engine", start)
        monkeypatch.setattr(
            VllmGenerator, "_end_engine", lambda g: (self.log.append("end"), setattr(g, "_actor", None))
        )
        monkeypatch.setattr(backend, "return_cached_blocks", lambda: self.log.append("return cached blocks"))
        self.end_on_release = end_on_release

    def open(self, model_dir: str) -> VllmGenerator:
        options = {"end_on_release": self.end_on_release}
        spec = ModelSpec(directory=model_dir)
        engine = open_generator("vllm", model=spec, device="cuda", weights="refit", options=options)
        engine.setup()
        return engine

    def take(self) -> list:
        taken, self.log[:] = list(self.log), []
        return taken


def test_a_sleeping_engine_gets_the_devices_memory_back_before_each_wake_and_its_kv_cache_only_to_generate(
    monkeypatch, tiny_dirs, prompts
):
    """The GPU's order of calls (a training step's peak sits in this process's PyTorch cache, where vLLM
    cannot map it; parallel.offload_during_generation moves the policy's weights away after the refit)."""
    batch, tokens = prompts
    rec = Recorder(monkeypatch, tokens, sleep_mode=True)
    engine = rec.open(tiny_dirs["qwen2_5_vl"])
    assert rec.take() == ["start", "sleep"]  # its weights come from the first refit
    buckets = [{"a": torch.zeros(2)}, {"b": torch.ones(3)}]
    engine.load_weights(iter(buckets))
    assert rec.take() == [
        "return cached blocks",
        "wake weights",
        "begin_refit",
        "load_bucket",
        "load_bucket",
        "finish_refit",
    ]
    engine.generate(batch, SamplingParams(temperature=0, max_new_tokens=2), n=1)
    assert rec.take() == ["return cached blocks", "wake kv_cache", "generate"]
    engine.generate(batch, SamplingParams(temperature=0, max_new_tokens=2), n=1)
    assert rec.take() == ["generate"]  # awake: nothing to wake
    engine.release_weights()
    assert rec.take() == ["sleep"]
    with pytest.raises(RuntimeError, match="released"):
        engine.generate(batch, SamplingParams(temperature=0, max_new_tokens=2), n=1)


@pytest.mark.parametrize("end_on_release", [True, False])
def test_without_sleep_mode_a_release_ends_the_engine_only_when_the_recipe_asks(
    monkeypatch, tiny_dirs, prompts, end_on_release
):
    """vLLM's CPU backend: generation.release_weights ends the engine's process (the next refit starts
    another); otherwise the engine keeps its memory. The first refit never restarts it."""
    batch, tokens = prompts
    rec = Recorder(monkeypatch, tokens, sleep_mode=False, end_on_release=end_on_release)
    engine = rec.open(tiny_dirs["qwen2_5_vl"])
    engine.load_weights({"a": torch.zeros(2)})
    assert rec.take() == ["start", "begin_refit", "load_bucket", "finish_refit"]
    engine.release_weights()
    assert rec.take() == (["end"] if end_on_release else [])
    with pytest.raises(RuntimeError, match="released"):
        engine.generate(batch, SamplingParams(temperature=0, max_new_tokens=2), n=1)
    engine.load_weights({"a": torch.zeros(2)})
    restarted = ["start"] if end_on_release else []
    assert rec.take() == [*restarted, "begin_refit", "load_bucket", "finish_refit"]


class FakeLLM:
    """vLLM's LLM as the engine process drives it: a log of the calls."""

    def __init__(self, log: list):
        self.log = log
        self.llm_engine = SimpleNamespace(reset_encoder_cache=lambda: log.append("reset_encoder_cache"))

    def __getattr__(self, name):
        return lambda *args, **kwargs: self.log.append(name if name != "sleep" else f"sleep level {kwargs['level']}")


@pytest.mark.parametrize("has_reset_mm_cache", [True, False])
def test_the_engine_resets_both_multimodal_caches_before_it_sleeps_and_after_a_refit(has_reset_mm_cache):
    """vLLM's front-end multimodal cache survives a sleep (only the engine's side is cleared): the same
    image sent again would name a cached item the engine no longer has. `LLM.reset_mm_cache` clears both,
    where the installed vLLM has it."""
    log: list = []
    engine = VllmEngine(model_dir="unused", dtype="float32", options={}, weights_from_refit=True)
    engine.llm = FakeLLM(log)
    engine.gates = EngineGates(
        sleep_mode=True, layerwise_reload=False, normalizes_pixels=True, reset_mm_cache=has_reset_mm_cache
    )
    engine.sleep()
    mm = ["reset_mm_cache"] if has_reset_mm_cache else []
    assert log == [*mm, "sleep level 2"]
    log.clear()
    engine._reset_caches()
    assert log == ["reset_prefix_cache", "reset_encoder_cache", *mm]
