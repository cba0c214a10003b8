"""What a GPU rank does differently, shown on a CPU: the policy in this process (one rank, gloo), the tiny
models. The root unit of a sharded model goes back to its shards after a forward without a backward;
GRPO's old and new log-probs come from the same mode of the model; a GPU rank computes on its share of
the node's CPUs, with the fused optimizer; a Nemotron-Omni GPU rank refuses to run without its Mamba
kernels; a step's statistics reach the host once, not once per micro-batch; a transformers that reads
`logits_to_keep` only as positions gives the same log-probs. (FSDP2 over several GPUs, NCCL and the
numbers: tools/gpu/multi_gpu_check.py on a GPU machine, docs/measurements.md.)"""

from __future__ import annotations

import os
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from data_samples import free_port

from vlmrun.data.batch import Batch
from vlmrun.models.spec import ModelSpec

pytestmark = pytest.mark.slow  # each builds a tiny policy (a process group, FSDP2): a few seconds
TRAIN = SimpleNamespace(
    seed=0,
    optimizer="adamw",
    lr=1e-3,
    betas=(0.9, 0.95),
    weight_decay=0.0,
    warmup_steps=0,
    lr_schedule="constant",
    min_lr_ratio=1.0,
    grad_clip=1.0,
)


def sharded(**extra) -> SimpleNamespace:
    base = dict(fsdp=True, mixed_precision="none", activation_checkpointing=False, cpu_offload=False)
    return SimpleNamespace(**(base | {"reduce_every_micro_batch": False} | extra))


def open_one(model_dir: str, parallel=None, train=TRAIN):
    from vlmrun.policy import open_policy

    policy = open_policy(
        "hf", model=ModelSpec(directory=model_dir), rank=0, world_size=1, train=train, parallel=parallel
    )
    policy.setup(master_addr="127.0.0.1", master_port=free_port(), max_steps=10)
    return policy


def text_batch(model_dir: str, text: str = "how many cubes are there? answer: 3") -> Batch:
    from transformers import AutoTokenizer

    ids = torch.tensor([AutoTokenizer.from_pretrained(model_dir).encode(text)])
    return Batch(["s"], ids, torch.ones_like(ids), ids.clone())


def test_a_forward_without_backward_gives_the_root_back_its_shards(tiny_dirs):
    """Before: the root (embeddings, head, towers) stayed gathered after `logprobs` until the next step."""
    from torch.distributed.tensor import DTensor

    model_dir = tiny_dirs["qwen2_5_vl"]
    policy = open_one(model_dir, sharded())
    try:
        batch = text_batch(model_dir)
        assert isinstance(policy.model.lm_head.weight, DTensor)
        policy.logprobs(batch)
        assert isinstance(policy.model.lm_head.weight, DTensor)  # sharded again, not the gathered Parameter
        policy.reference_logprobs(batch)
        assert isinstance(policy._reference.lm_head.weight, DTensor)
        policy.train_step([batch])  # the next step gathers as it always did
        assert isinstance(policy.model.lm_head.weight, DTensor)
    finally:
        policy.shutdown()


def test_old_and_new_logprobs_come_from_the_same_mode_of_the_model(tiny_dirs):
    """NemotronH's Mamba takes its fused kernel in train mode and the unfused one in eval mode: the
    logprob stage must run the model as the training forward does."""
    model_dir = tiny_dirs["nemotron_omni"]
    policy = open_one(model_dir, sharded())
    modes = []
    try:
        batch = text_batch(model_dir)
        for m in (policy.model,):
            m.register_forward_pre_hook(lambda module, args: modes.append(("policy", module.training)))
        policy.logprobs(batch)
        policy.reference_logprobs(batch)
        policy._reference.register_forward_pre_hook(lambda module, args: modes.append(("reference", module.training)))
        policy.reference_logprobs(batch)
        policy.train_step([batch])
    finally:
        policy.shutdown()
    assert modes == [("policy", True), ("reference", True), ("policy", True)]


def test_a_gpu_rank_computes_on_its_share_of_the_node_s_cpus(tiny_dirs, monkeypatch):
    from vlmrun.algorithms.common.worker import RankWorker
    from vlmrun.config.load import load_recipe

    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", os.environ.get("PYTORCH_CUDA_ALLOC_CONF", ""))
    before = torch.get_num_threads()
    recipe = Path(__file__).resolve().parents[1] / "recipes" / "tiny-clevr-cpu.yaml"
    try:
        for sets, threads in ((["cluster.gpus_per_node=2", "cluster.cpus_per_node=16"], 8), ([], 1)):
            r = load_recipe(recipe, sets)
            RankWorker(rank=0, world_size=1, recipe_json=r.model_dump_json(), model_dir=tiny_dirs["qwen2_5_vl"])
            assert torch.get_num_threads() == threads == (r.cluster.threads_per_gpu_rank if sets else 1)
    finally:
        torch.set_num_threads(before)


def test_a_gpu_rank_s_optimizer_is_fused_and_a_cpu_rank_s_keeps_its_order(tiny_dirs):
    from vlmrun.policy.optimizer import build_optimizer

    model_dir = tiny_dirs["qwen2_5_vl"]
    policy = open_one(model_dir, sharded())
    try:
        assert policy.optimizer.param_groups[0]["foreach"] is False and not policy.optimizer.param_groups[0]["fused"]
        fused, scheduler = build_optimizer(policy.params, TRAIN, 10, fused=True)  # on the sharded (DTensor) parameters
        policy.optimizer, policy.scheduler = fused, scheduler
        before = [p.detach().clone() for p in policy.params]
        policy.train_step([text_batch(model_dir)])
        assert fused.param_groups[0]["fused"] and any(
            not torch.equal(a, b) for a, b in zip(before, policy.params, strict=True)
        )
        sgd, _ = build_optimizer(policy.params, SimpleNamespace(**(vars(TRAIN) | {"optimizer": "sgd"})), 10, fused=True)
        assert sgd.param_groups[0]["foreach"]  # torch has no DTensor rule for SGD's fused kernel
    finally:
        policy.shutdown()


def test_a_nemotron_gpu_rank_refuses_to_run_without_its_mamba_kernels(tiny_dirs):
    from vlmrun.models.build import build_model
    from vlmrun.policy.kernels import check_cuda_kernels, kernels_needed

    omni = build_model(ModelSpec(directory=tiny_dirs["nemotron_omni"]), on_meta=True)
    qwen = build_model(ModelSpec(directory=tiny_dirs["qwen2_5_vl"]), on_meta=True)
    assert kernels_needed(omni) == ("causal_conv1d", "mamba_ssm") and kernels_needed(qwen) == ()
    check_cuda_kernels(omni, torch.device("cpu"))  # the CPU runs the reference path
    check_cuda_kernels(qwen, torch.device("cuda"))  # nothing to import
    with pytest.raises(
        RuntimeError,
        match=r"needs causal_conv1d \(ModuleNotFoundError.*mamba_ssm \(ModuleNotFoundError.*'vlmrun\[gpu\]'",
    ):
        check_cuda_kernels(omni, torch.device("cuda"))


def test_a_step_brings_its_statistics_to_the_host_once_not_per_micro_batch(tiny_dirs, monkeypatch):
    """GRPO's loss gives its statistics as tensors, the policy sums the losses on the device: the host
    reads from the device a fixed number of times a step (float, item, tolist), whatever the micro-batches."""
    from vlmrun.algorithms.grpo.loss import ClippedPgLoss
    from vlmrun.algorithms.grpo.micro_batches import PgMicroBatch
    from vlmrun.config.grpo import GrpoConfig

    model_dir = tiny_dirs["qwen2_5_vl"]
    policy = open_one(model_dir, sharded())
    batch = text_batch(model_dir)
    width = batch.input_ids.shape[1] - 1
    pg = PgMicroBatch(batch, torch.ones(1, width), torch.zeros(1, width), torch.zeros(1, width))
    reads = []
    for name in ("__float__", "item", "tolist"):
        original = getattr(torch.Tensor, name)
        monkeypatch.setattr(torch.Tensor, name, lambda self, *a, _o=original, **k: reads.append(1) or _o(self, *a, **k))
    try:
        counts = []
        for n in (1, 4):
            reads.clear()
            policy.train_step([pg] * n, ClippedPgLoss(GrpoConfig(kl_coef=0.0)))
            counts.append(len(reads))
    finally:
        policy.shutdown()
    assert counts[0] == counts[1], counts


def test_positions_instead_of_a_mask_give_the_same_logprobs(tiny_dirs):
    """transformers before 5.20 (the lent GPU machine's 5.17) takes `logits_to_keep` as positions only."""
    from vlmrun.policy import loss

    model_dir = tiny_dirs["qwen2_5_vl"]
    policy = open_one(model_dir)
    try:
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(model_dir)
        rows = [tok.encode("how many cubes? answer: 3"), tok.encode("what color is the big sphere? answer: red")]
        width = max(len(r) for r in rows)
        ids = torch.tensor([r + [0] * (width - len(r)) for r in rows])
        labels = ids.clone()
        labels[0, :4] = labels[1, :7] = -100
        labels[0, len(rows[0]) :] = -100
        b = Batch(["a", "b"], ids, (labels != -100) | (ids != 0), labels)
        mask_path = policy.logprobs(b)
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(loss, "takes_a_mask", lambda: False)
            positions = policy.logprobs(b)
        torch.testing.assert_close(positions, mask_path, rtol=0, atol=1e-5)
        assert (mask_path != 0).sum() == (labels[:, 1:] != -100).sum()
    finally:
        policy.shutdown()
