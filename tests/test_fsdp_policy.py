"""The hf policy sharded with FSDP2 against the replicated policy, on CPU with 2 gloo ranks.

Each layout runs in its own pair of spawned processes over the same micro-batches (image batches from
the session's CLEVR set; rank 0's last is text-only, so the vision tower gets no gradient from it); losses, gradient norms and final parameters must be bitwise equal. The optimizer
state a sharded resume loads into is torch's own layout. (A sharded checkpoint resumed: tests/test_gpu_check.py,
tests/test_sharded_load.py and, through the CLI, tests/test_fsdp_runs.py.)
"""

from __future__ import annotations

import os

import pytest
import torch
from data_samples import FAMILIES, free_port, make_recipe, rank_policy, start_ranks

pytestmark = pytest.mark.slow  # two ranks per layout build FSDP2 and train: ~3-7 s a test
STEPS = 4


def _text_only_batch(tokenizer, rank: int):
    from vlmrun.data.batch import Batch

    ids = torch.tensor([tokenizer.encode("how many cubes are there? answer: 3 cubes")])
    return Batch([f"text-{rank}"], ids, torch.ones_like(ids), ids.clone())


def _rank_main(rank, world, recipe, model_dir, batches, layout, port, out, all_text, offload):
    """One rank: STEPS steps (rank 0's last micro-batch is text-only, or all of them with `all_text`);
    rank 0 writes rows and weights. With `offload`, each step is followed by a GRPO rollout's moves
    (the optimizer's state to the host, a refit, the weights and the reference model's), checked
    empty on the device, and back."""
    torch.set_num_threads(1)
    policy, _ = rank_policy(recipe, rank, world, model_dir, layout, port)
    mine = batches[rank::world]
    if rank == 0:  # ranks take the same number of micro-batches (FSDP2 gathers per forward)
        from transformers import AutoTokenizer

        text = _text_only_batch(AutoTokenizer.from_pretrained(model_dir), rank)
        mine = [text] * len(mine) if all_text else [*mine[:-1], text]
    rows = []
    for _ in range(STEPS):
        rows.append(policy.train_step(mine))
        if offload:
            _offloaded_and_back(policy, mine[0])
    weights = {name: t for bucket in policy.weights_for_refit(bucket_bytes=1 << 16) for name, t in bucket.items()}
    if rank == 0:
        torch.save({"rows": [(r.loss, r.grad_norm, r.valid_tokens) for r in rows], "weights": weights}, out)
    policy.shutdown()
    os._exit(0)  # skip interpreter teardown: gloo's threads sometimes abort in C++ destructors at exit


def _offloaded_and_back(policy, batch) -> None:
    """GrpoWorker.rollout's moves with parallel.offload_during_generation, checked: what moved holds no
    device memory until it is back, and the reference model scores `batch` as before."""
    from vlmrun.checkpoint.parts import MODEL_PART, OPTIMIZER_PART

    def held(tensors) -> int:
        return sum((t.to_local() if hasattr(t, "to_local") else t).untyped_storage().nbytes() for t in tensors)

    state = [t for s in policy.optimizer.state.values() for t in s.values() if torch.is_tensor(t)]
    before = policy.reference_logprobs(batch)  # builds the reference model the first time
    moved = policy.offload_to_host((OPTIMIZER_PART,))
    assert held(state) == 0 and moved > 0 and held(policy.model.parameters()) > 0
    assert any(t.numel() for bucket in policy.weights_for_refit(bucket_bytes=1 << 16) for t in bucket.values())
    moved += policy.offload_to_host((MODEL_PART,))
    assert held(policy.model.parameters()) == held(policy._reference.parameters()) == 0
    assert policy.restore_from_host() == moved and held(state) > 0
    assert torch.equal(policy.reference_logprobs(batch), before)


def _run(tmp_path, name, recipe, model_dir, batches, *, layout, all_text=False, offload=False):
    out = tmp_path / f"{name}.pt"
    args = (2, recipe, model_dir, batches, layout, free_port(), str(out), all_text, offload)
    start_ranks(_rank_main, args)
    return torch.load(out, weights_only=False)


@pytest.fixture(scope="module")
def setup(clevr_set, tiny_dirs, request):
    from vlmrun.data.loader import val_batches

    family = request.param
    recipe = make_recipe(clevr_set, family=family, train={"lr": 1e-2, "grad_clip": 0.5})
    loss_batches, _, _ = val_batches(recipe, processor_dir=tiny_dirs[family], samples=8, batch_size=2)
    return recipe, tiny_dirs[family], loss_batches


@pytest.mark.parametrize("setup", FAMILIES, indirect=True)
def test_fsdp_matches_replicated_bitwise_with_a_text_only_micro_batch(setup, tmp_path):
    """The sharded policy's state also goes to host memory and back after every step (GRPO's rollout
    with parallel.offload_during_generation): nothing of it changes."""
    recipe, model_dir, batches = setup
    replicated = _run(tmp_path, "replicated", recipe, model_dir, batches, layout={"fsdp": False})
    sharded = _run(tmp_path, "sharded", recipe, model_dir, batches, layout={"fsdp": True}, offload=True)
    assert sharded["rows"] == replicated["rows"]
    assert len({r[1] for r in sharded["rows"]}) == STEPS  # the steps moved the weights
    assert sharded["weights"].keys() == replicated["weights"].keys()
    for name, w in replicated["weights"].items():
        assert torch.equal(sharded["weights"][name], w), name


@pytest.mark.parametrize("setup", ["nemotron_omni"], indirect=True)
def test_bf16_mixed_precision_trains_with_a_rank_of_text_only_micro_batches(setup, tmp_path):
    """bf16 over fp32 master weights, activation checkpointing: rank 0 sees no image in the step (the
    vision tower gets no gradient there), rank 1 only images (Nemotron's video projection gets none)."""
    recipe, model_dir, batches = setup
    layout = {"fsdp": True, "mixed_precision": "bf16", "activation_checkpointing": True}
    got = _run(tmp_path, "bf16", recipe, model_dir, batches, layout=layout, all_text=True)
    losses = [row[0] for row in got["rows"]]
    assert all(loss == loss and loss < 20 for loss in losses) and losses[-1] < losses[0]
    assert {w.dtype for w in got["weights"].values() if w.is_floating_point()} == {torch.float32}  # fp32 masters


def _describe(optimizer) -> list[dict]:
    """Per parameter, per state key: what a DCP load needs of the tensor it fills."""

    def one(t) -> tuple:
        local = t.to_local() if hasattr(t, "to_local") else t
        return (
            type(t).__name__,
            t.dtype,
            tuple(t.shape),
            str(getattr(t, "placements", "")),
            tuple(local.shape),
            local.device.type,
        )

    return [
        {key: one(value) for key, value in optimizer.state[p].items()}
        for group in optimizer.param_groups
        for p in group["params"]
    ]


def _state_layouts(rank, world, recipe, model_dir, port, out):
    from torch.distributed.checkpoint.state_dict import _init_optim_state

    from vlmrun.policy.optimizer import allocate_state

    torch.set_num_threads(1)
    policy, _ = rank_policy(recipe, rank, world, model_dir, {"fsdp": True}, port)
    allocate_state(policy.optimizer)
    ours = _describe(policy.optimizer)
    policy.optimizer.state.clear()
    _init_optim_state(policy.optimizer)  # what torch's get_state_dict does for an optimizer without state
    if rank == 0:
        torch.save({"ours": ours, "torch": _describe(policy.optimizer)}, out)
    policy.shutdown()
    os._exit(0)


@pytest.mark.parametrize("setup", ["qwen2_5_vl"], indirect=True)
def test_the_state_a_sharded_resume_loads_into_has_torchs_layout(setup, tmp_path):
    """`allocate_state` (vlmrun/policy/optimizer.py) stands in for torch's zero-gradient step: each
    parameter's AdamW state has the keys, dtypes, shapes, shard placements and devices torch makes."""
    recipe, model_dir, _ = setup
    out = tmp_path / "layouts.pt"
    start_ranks(_state_layouts, (2, recipe, model_dir, free_port(), str(out)))
    got = torch.load(out, weights_only=False)
    assert got["ours"] == got["torch"] and len(got["ours"]) > 10
    assert {v[0] for row in got["ours"] for v in row.values()} == {"DTensor", "Tensor"}  # moments sharded, step not
