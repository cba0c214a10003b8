"""Backends come from the factories: `open_policy` (model.backend), `open_generator` (generation.backend)
and the controller of `train.algorithm`; an unknown name is refused naming the field. A policy and a
generation engine build from a model directory or from a config (random init, seeded), and a
config-built policy trains."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from vlmrun.checkpoint.parts import MODEL_PART, Storage
from vlmrun.config.train import TrainConfig
from vlmrun.data.batch import Batch
from vlmrun.errors import InputError
from vlmrun.generation import open_generator
from vlmrun.generation.interface import SamplingParams
from vlmrun.models.spec import ModelSpec
from vlmrun.policy import open_policy

TINY = Path(__file__).resolve().parents[1] / "recipes" / "tiny-clevr-cpu.yaml"
TRAIN = TrainConfig(lr=1e-2, warmup_steps=0, lr_schedule="constant")


def _config(tiny_dirs) -> dict:
    return json.loads((Path(tiny_dirs["qwen2_5_vl"]) / "config.json").read_text())


def _text_batch(tokenizer) -> Batch:
    ids = torch.tensor([tokenizer.encode("how many cubes are there? answer: 3 cubes")])
    return Batch(["text-0"], ids, torch.ones_like(ids), ids.clone())


def _random_init_policy(config: dict, seed: int):
    policy = open_policy("hf", model=ModelSpec(config=config, seed=seed), rank=0, world_size=1, train=TRAIN)
    policy.setup(master_addr="127.0.0.1", master_port=0, max_steps=4)  # one replica: no process group
    return policy


@pytest.mark.parametrize(
    "open_backend, field",
    [
        (lambda: open_policy("deepspeed", model=ModelSpec(directory="/m"), rank=0, world_size=1, train=TRAIN), "model"),
        (lambda: open_generator("sglang", model=ModelSpec(directory="/m")), "generation"),
    ],
)
def test_an_unknown_backend_is_refused_naming_its_field(open_backend, field):
    with pytest.raises(InputError) as e:
        open_backend()
    assert (
        e.value.field == f"{field}.backend"
        and str(e.value).startswith(f"{field}.backend: ")
        and "one of hf" in str(e.value)
    )


def test_the_node_finds_each_algorithms_controller_and_refuses_an_unknown_one():
    from vlmrun.algorithms.controllers import controller_class
    from vlmrun.algorithms.grpo.controller import GrpoController
    from vlmrun.algorithms.sft.controller import SftController

    assert controller_class("sft") is SftController and controller_class("grpo") is GrpoController
    with pytest.raises(InputError, match=r"^train.algorithm: 'ppo' is not allowed; one of grpo, sft"):
        controller_class("ppo")


NODE_IMPORTS = """
import sys
import vlmrun.cluster.node, vlmrun.algorithms.common.driver
from vlmrun.algorithms.controllers import controller_host
hosts = [controller_host("sft").__name__, controller_host("grpo").__name__]
print(hosts, sorted(m for m in ("torch", "transformers") if m in sys.modules))
"""


def test_the_node_starts_a_controller_actor_named_as_the_controller_without_importing_torch():
    """The node passes a stand-in (its actor imports the controller): the node's process never spends
    the ~1.3 s of CPU of importing torch, and Ray's titles still read ray::SftController.run()."""
    import subprocess
    import sys

    from vlmrun.algorithms.controllers import controller_host

    out = subprocess.run([sys.executable, "-c", NODE_IMPORTS], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "['SftController', 'GrpoController'] []"
    with pytest.raises(InputError, match=r"^train.algorithm: 'ppo' is not allowed; one of grpo, sft"):
        controller_host("ppo")


def test_a_model_spec_names_one_source():
    with pytest.raises(ValueError, match="exactly one of"):
        ModelSpec()
    with pytest.raises(ValueError, match="exactly one of"):
        ModelSpec(directory="/m", config={"model_type": "qwen2_5_vl"})
    with pytest.raises(ValueError, match="model_type"):
        ModelSpec(config={"hidden_size": 8})
    with pytest.raises(ValueError, match="dtype"):
        ModelSpec(directory="/m", dtype="float16")


def test_dry_run_prints_the_generation_section(tmp_path):
    from vlmrun.launch.submit import submit_run

    result = submit_run(TINY, [], cluster="local", run_dir=tmp_path / "r", dry_run=True)
    assert "\ngeneration:\n  backend: hf\n" in result.rendered and not (tmp_path / "r").exists()


def test_a_config_built_random_init_policy_is_seeded_and_trains_one_step(tiny_dirs):
    from transformers import AutoTokenizer

    config = _config(tiny_dirs)
    batch = _text_batch(AutoTokenizer.from_pretrained(tiny_dirs["qwen2_5_vl"]))
    a, same, other = (_random_init_policy(config, seed) for seed in (5, 5, 6))
    weights = {name: w.clone() for name, w in a.checkpoint_state().parts[MODEL_PART].items()}
    assert a.checkpoint_state().storage is Storage.REPLICATED
    assert all(torch.equal(w, same.checkpoint_state().parts[MODEL_PART][n]) for n, w in weights.items())
    assert not all(torch.equal(w, other.checkpoint_state().parts[MODEL_PART][n]) for n, w in weights.items())
    before = a.logprobs(batch)
    first, second = a.train_step([batch]), a.train_step([batch])
    assert first.valid_tokens == batch.labels.shape[1] - 1 and torch.isfinite(torch.tensor(first.loss))
    assert second.loss < first.loss  # the step moved the weights towards the batch
    assert torch.equal(a.reference_logprobs(batch), before)  # the reference is the same seeded init
    for p in (a, same, other):
        p.shutdown()


def test_a_config_built_generator_takes_the_policys_weights(tiny_dirs):
    from transformers import AutoTokenizer

    from vlmrun.data.batch import PromptBatch

    config = _config(tiny_dirs)
    policy = _random_init_policy(config, seed=5)
    engine = open_generator("hf", model=ModelSpec(config=config, seed=9))
    assert engine.setup()["image_token_id"] == config["image_token_id"]
    engine.load_weights(policy.weights_for_refit())
    ids = torch.tensor([AutoTokenizer.from_pretrained(tiny_dirs["qwen2_5_vl"]).encode("how many cubes?")])
    rollouts = engine.generate(PromptBatch(["p"], ids, torch.ones_like(ids), ["3"]), SamplingParams(temperature=0), n=1)
    forward = policy.logprobs(rollouts.training_batch())
    assert torch.allclose(rollouts.response_logprobs(forward), rollouts.logprobs, atol=1e-5)  # the same weights
    policy.shutdown()


def test_a_gpu_rank_grows_cuda_segments_unless_the_environment_says_otherwise(monkeypatch):
    from vlmrun.policy.device import CUDA_ALLOC_CONF

    spec = ModelSpec(directory="/m")
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "")  # so the test leaves the variable as it found it
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF")
    open_policy("hf", model=spec, rank=0, world_size=1, train=TRAIN)  # a CPU rank leaves the variable alone
    assert "PYTORCH_CUDA_ALLOC_CONF" not in os.environ
    open_policy("hf", model=spec, rank=0, world_size=1, train=TRAIN, gpus=True)  # set before setup touches CUDA
    assert os.environ["PYTORCH_CUDA_ALLOC_CONF"] == CUDA_ALLOC_CONF == "expandable_segments:True"
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "max_split_size_mb:512")
    open_policy("hf", model=spec, rank=0, world_size=1, train=TRAIN, gpus=True)
    assert os.environ["PYTORCH_CUDA_ALLOC_CONF"] == "max_split_size_mb:512"  # the user's own wins


def test_the_attention_kernel_of_the_spec_is_the_one_the_model_runs(tiny_dirs):
    from vlmrun.models.build import build_model

    config = _config(tiny_dirs)
    for source in ({"config": config}, {"directory": tiny_dirs["qwen2_5_vl"]}):
        for attn in ("eager", "sdpa"):
            model = build_model(ModelSpec(**source, attn_implementation=attn))
            assert model.config._attn_implementation == attn, (source.keys(), attn)


def test_tools_open_backends_through_the_factories_only():
    """import-linter sees the package, not tools/: the same forbidden backend modules, checked here."""
    import ast
    import tomllib

    root = Path(__file__).resolve().parents[1]
    contracts = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["importlinter"]["contracts"]
    (backends,) = [c["forbidden_modules"] for c in contracts if c["name"].startswith("backends:")]
    found = []
    for path in sorted((root / "tools").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module, *(f"{node.module}.{a.name}" for a in node.names)]
            else:
                continue
            found += [f"{path.relative_to(root)}:{node.lineno} {n}" for n in names if n in backends]
    assert backends and not found, f"tools import backend modules instead of open_policy / open_generator: {found}"
