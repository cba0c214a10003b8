"""A run's rank (RankWorker) and `vlmrun eval` open the policy and the generation engine the same way
(algorithms/common/rank_backends.py): the same model, dtype and attention kernel reach the policy, and
the same engine settings, the recipe's vLLM options included, reach the engine."""

from __future__ import annotations

import pytest
import torch

from vlmrun import generation, policy
from vlmrun.config.load import validate

OPENED: dict[str, list[dict]] = {"policy": [], "engine": []}


class RecordingPolicy:
    """A policy backend that keeps what it was opened with."""

    def __init__(self, **kwargs):
        OPENED["policy"].append(kwargs)

    def setup(self, **kwargs) -> dict:
        return {}

    def shutdown(self) -> None:
        pass


class RecordingEngine:
    """A generation backend that keeps what it was opened with."""

    eos_ids = (0,)

    def __init__(self, **kwargs):
        OPENED["engine"].append(kwargs)

    def setup(self) -> dict:
        return {"image_token_id": 0}

    def shutdown(self) -> None:
        pass


@pytest.fixture
def recording(monkeypatch):
    OPENED["policy"].clear()
    OPENED["engine"].clear()
    monkeypatch.setitem(policy.BACKENDS, "hf", f"{__name__}:RecordingPolicy")
    monkeypatch.setitem(generation.BACKENDS, "vllm", f"{__name__}:RecordingEngine")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # eval asks this machine for the recipe's GPU
    return OPENED


def _vllm_recipe(data_path):
    return validate(
        {
            "name": "rank-backends",
            "model": {"family": "qwen2_5_vl", "tiny": True, "dtype": "bfloat16"},
            "data": {"path": str(data_path), "max_seq_len": 256},
            "train": {"algorithm": "grpo", "micro_batch_size": 1, "global_batch_size": 1},
            "grpo": {"max_new_tokens": 16},
            "parallel": {"dp": 1},
            "cluster": {"nodes": 1, "gpus_per_node": 1},
            "generation": {
                "backend": "vllm",
                "vllm": {"gpu_memory_utilization": 0.3, "max_num_seqs": 7, "enforce_eager": True},
            },
        }
    )


def test_eval_and_a_runs_rank_open_the_policy_and_the_engine_alike(recording, tmp_path, tiny_dirs):
    from vlmrun.algorithms.common.worker import RankWorker
    from vlmrun.launch.eval import _open

    recipe, model_dir = _vllm_recipe(tmp_path), tiny_dirs["qwen2_5_vl"]
    worker = RankWorker(rank=0, world_size=1, recipe_json=recipe.model_dump_json(), model_dir=model_dir, threads=1)
    worker._open_engine()
    _open(recipe, model_dir, threads=1)

    (rank_policy, eval_policy), (rank_engine, eval_engine) = recording["policy"], recording["engine"]
    assert eval_engine == rank_engine
    assert rank_engine["options"] == {
        "engine": {
            "gpu_memory_utilization": 0.3,
            "max_model_len": 256 + 16,
            "max_num_seqs": 7,
            "enforce_eager": True,
            "enable_prefix_caching": True,
        },
        "env": None,
        "end_on_release": False,
    }
    assert rank_engine["device"] == "cuda" and rank_engine["weights_from_refit"]
    # eval holds the whole model in its one process: replicated, with none of the run's sharding
    assert rank_policy.pop("parallel") == recipe.parallel and eval_policy.pop("parallel") is None
    assert eval_policy == rank_policy
    assert rank_policy["model"].dtype == "bfloat16" and rank_policy["gpus"]
