"""Run by tests/test_vllm_classes.py in a process of its own, with vLLM's classes on PYTHONPATH
(.vllm-classes/): each tiny model's policy refits vLLM's own model class of its family on the CPU, one
model after the other in this process (vLLM is imported once). Prints one JSON line per model. vLLM's attention kernels are never run: its platform on a CPU-only machine
names no attention backend, so the probe names the CPU one, which only has to construct."""

from __future__ import annotations

import json
import os
import sys
import tempfile

os.environ.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")

import torch

from vlmrun.config.train import TrainConfig
from vlmrun.generation.vllm_weights import engine_targets, refit_model
from vlmrun.models.spec import ModelSpec
from vlmrun.policy import open_policy


def main(model_dirs: list[str]) -> None:
    from vllm.platforms import current_platform

    cpu_attention = "vllm.v1.attention.backends.cpu_attn.CPUAttentionBackend"
    type(current_platform).get_attn_backend_cls = classmethod(lambda cls, *a, **k: cpu_attention)
    for n, model_dir in enumerate(model_dirs):
        print(json.dumps(probe(model_dir, first=n == 0)), flush=True)


def probe(model_dir: str, first: bool) -> dict:
    import vllm
    from vllm.config import DeviceConfig, ModelConfig, VllmConfig, set_current_vllm_config
    from vllm.distributed.parallel_state import init_distributed_environment, initialize_model_parallel
    from vllm.model_executor.model_loader.utils import get_model_architecture

    policy = open_policy("hf", model=ModelSpec(directory=model_dir), rank=0, world_size=1, train=TrainConfig())
    policy.setup(master_addr="127.0.0.1", master_port=1, max_steps=1)
    buckets = list(policy.weights_for_refit(dtype="float32", bucket_bytes=1 << 16))
    tensors = {name: t for bucket in buckets for name, t in bucket.items()}
    config = ModelConfig(
        model=model_dir, tokenizer=model_dir, dtype="float32", skip_tokenizer_init=True, enforce_eager=True
    )
    vc = VllmConfig(model_config=config, device_config=DeviceConfig(device="cpu"))
    with set_current_vllm_config(vc):
        if first:  # one process group for all the models
            rendezvous = f"file://{tempfile.mktemp(prefix='vlmrun-vllm-')}"
            init_distributed_environment(
                world_size=1, rank=0, local_rank=0, distributed_init_method=rendezvous, backend="gloo"
            )
            initialize_model_parallel(1, 1)
        cls, arch = get_model_architecture(config)
        engine = cls(vllm_config=vc, prefix="")
        targets = engine_targets(engine, tensors)
        params = dict(engine.named_parameters())
        for p in params.values():  # filled again by the bucketed refit the product runs
            p.data.zero_()
        filled = refit_model(engine, buckets)
        same = [
            n for n, t in tensors.items() if len(targets[n]) == 1 and params[next(iter(targets[n]))].shape == t.shape
        ]
        equal = all(torch.equal(params[next(iter(targets[n]))], tensors[n]) for n in same)
    return {
        "model_dir": model_dir,
        "vllm": vllm.__version__,
        "torch": torch.__version__,
        "architecture": arch,
        "policy_tensors": len(tensors),
        "engine_params": len(params),
        "targets": {n: sorted(t) for n, t in targets.items()},
        "filled": sorted(filled),
        "unfused_equal": equal,
        "unfused": len(same),
        "buckets": len(buckets),
        "backend": backend_objects(model_dir) if first else None,
    }


def backend_objects(model_dir: str) -> dict:
    """vLLM's own SamplingParams from the backend's options, and its own output objects read back
    into rollouts (vlmrun/generation/vllm.py)."""
    from vllm import SamplingParams
    from vllm.logprobs import Logprob
    from vllm.outputs import CompletionOutput, RequestOutput

    from vlmrun.data.batch import PromptBatch
    from vlmrun.generation.interface import SamplingParams as Ours
    from vlmrun.generation.special_tokens import SpecialTokens
    from vlmrun.generation.vllm import response_seed, rollouts_from, sampling_options

    tokens = SpecialTokens.of_directory(model_dir)
    ours = Ours(temperature=0.7, top_p=0.9, max_new_tokens=3, seed=5)
    sampled = SamplingParams(**sampling_options(ours, response_seed(5, 0, "a", 1), tokens))
    greedy = SamplingParams(**sampling_options(ours, None, tokens))
    eos = tokens.eos_ids[0]
    drawn = [[11, eos, 12], [13, 14, 15]]
    outputs = [
        RequestOutput(
            request_id=str(i),
            prompt=None,
            prompt_token_ids=[1, 2],
            prompt_logprobs=None,
            outputs=[
                CompletionOutput(
                    index=0,
                    text="",
                    token_ids=ids,
                    cumulative_logprob=None,
                    logprobs=[{t: Logprob(-0.5 * (k + 1))} for k, t in enumerate(ids)],
                    finish_reason="stop" if eos in ids else "length",
                )
            ],
            finished=True,
        )
        for i, ids in enumerate(drawn)
    ]
    batch = PromptBatch(["p", "p"], torch.tensor([[1, 2], [1, 2]]), torch.ones(2, 2, dtype=torch.long), ["3", "3"])
    rollouts = rollouts_from(outputs, batch, n=2, tokens=tokens, generate_s=0.0)
    return {
        "sampled": [sampled.seed, sampled.temperature, sampled.top_p, sampled.logprobs, sampled.max_tokens],
        "stop_token_ids": list(sampled.stop_token_ids or []),
        "greedy_temperature": greedy.temperature,
        "logit_bias": sorted((sampled.logit_bias or {}).keys()),
        "never_generated": list(tokens.never_generated),
        "eos": list(tokens.eos_ids),
        "response_ids": rollouts.response_ids.tolist(),
        "response_mask": rollouts.response_mask.tolist(),
        "logprobs": rollouts.logprobs.tolist(),
        "pad": tokens.pad_token_id,
    }


if __name__ == "__main__":
    main(sys.argv[1:])
