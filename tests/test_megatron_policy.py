"""The megatron policy on spawned gloo ranks, layout by layout, against the hf policy on the same batches.

One module fixture trains each layout 3 steps over the same two micro-batches of the session's CLEVR set
(one replica takes both; at dp=2 each replica one): tp=2 x pp=2 first, which writes a checkpoint after
its first step through the checkpoint store (pieces of HF tensors); every later layout then also reads
that checkpoint into its own tp x pp and takes one step more. Each layout's refit before training
gives the HF model's tensors bitwise (gathered over tp, collected over pp). The hf policy (one process)
gives the reference numbers. The same through the CLI: tests/test_megatron_runs.py.
"""

from __future__ import annotations

import os

import pytest
import torch
from data_samples import free_port, make_recipe, start_ranks

pytestmark = pytest.mark.slow  # a layout's ranks build megatron-core and train: ~10-25 s each
STEPS = 3
LAYOUTS = {
    "tp2pp2": {"tp": 2, "pp": 2},
    "tp1": {},
    "tp2": {"tp": 2},
    "pp2": {"pp": 2},
    "dp2tp2_sp_recompute": {"dp": 2, "tp": 2, "sequence_parallel": True, "activation_checkpointing": True},
}


def _batches(clevr_set, model_dir):
    from vlmrun.data.loader import val_batches

    recipe = make_recipe(clevr_set, train={"micro_batch_size": 2, "global_batch_size": 4})
    loss, _, _ = val_batches(recipe, processor_dir=model_dir, samples=4, batch_size=2)
    return recipe, loss[:2]


def _rank_main(rank, world, recipe, model_dir, batches, layout, port, out, pending, checkpoint):
    """One rank of one layout: its refit, reference check, steps, checkpoint write or read; its results to `out`."""
    torch.set_num_threads(1)
    from vlmrun.checkpoint.parts import MODEL_PART, OPTIMIZER_PART, PolicyState
    from vlmrun.models.spec import ModelSpec
    from vlmrun.policy import open_policy

    parallel = recipe.parallel.model_copy(update={"dp": 1, **layout})
    policy = open_policy(
        "megatron",
        model=ModelSpec(directory=model_dir),
        rank=rank,
        world_size=world,
        train=recipe.train,
        parallel=parallel,
    )
    policy.setup(master_addr="127.0.0.1", master_port=port, max_steps=10)
    refit = {n: t.clone() for bucket in policy.weights_for_refit(bucket_bytes=1 << 14) for n, t in bucket.items()}
    same_reference = torch.equal(policy.reference_logprobs(batches[0]), policy.logprobs(batches[0]))
    dp = parallel.dp
    mine = batches[policy.coords.dp :: dp]
    rows, written = [], {}
    for step in range(STEPS):
        rows.append(policy.train_step(mine))
        if step == 0 and pending is not None:
            written = pending.write_policy(policy.checkpoint_state(), rank=rank)
    resumed = None
    if checkpoint is not None:
        parts = PolicyState(policy.checkpoint_state().storage, {MODEL_PART: None, OPTIMIZER_PART: None})
        policy.load_checkpoint_state(checkpoint.read_policy(parts))
        resumed = policy.train_step(mine).loss
    result = {"rows": [(r.loss, r.grad_norm) for r in rows], "refit": refit, "same_reference": same_reference}
    torch.save(result | {"resumed": resumed, "written": written}, f"{out}.{rank}")
    policy.shutdown()
    os._exit(0)  # skip interpreter teardown: gloo's threads sometimes abort in C++ destructors at exit


def _layout(tmp_path, name, recipe, model_dir, batches, pending=None, checkpoint=None):
    layout = LAYOUTS[name]
    world = layout.get("dp", 1) * layout.get("tp", 1) * layout.get("pp", 1)
    out = tmp_path / name
    start_ranks(
        _rank_main, (world, recipe, model_dir, batches, layout, free_port(), str(out), pending, checkpoint), world
    )
    results = [torch.load(f"{out}.{r}", weights_only=False) for r in range(world)]
    return results[0] | {"written": {f: d for r in results for f, d in r["written"].items()}}


@pytest.fixture(scope="module")
def runs(tmp_path_factory, clevr_set, tiny_dirs):
    from vlmrun.checkpoint.store import CheckpointStore
    from vlmrun.models.spec import ModelSpec
    from vlmrun.policy import open_policy

    tmp = tmp_path_factory.mktemp("megatron-layouts")
    model_dir = tiny_dirs["qwen2_5_vl"]
    recipe, batches = _batches(clevr_set, model_dir)
    hf = open_policy("hf", model=ModelSpec(directory=model_dir), rank=0, world_size=1, train=recipe.train)
    hf.setup(master_addr="127.0.0.1", master_port=0, max_steps=10)  # one replica: no process group
    out = {"hf": {"rows": [(r.loss, r.grad_norm) for r in (hf.train_step(batches) for _ in range(STEPS))]}}
    hf.shutdown()
    store = CheckpointStore(tmp / "checkpoints", keep=1)
    pending = store.begin(1)
    out["tp2pp2"] = _layout(tmp, "tp2pp2", recipe, model_dir, batches, pending=pending)
    written = out["tp2pp2"]["written"] | pending.write("controller", {"counters": {}})
    store.finish(pending, written, None)
    checkpoint, _ = store.latest()
    for name in [n for n in LAYOUTS if n != "tp2pp2"]:
        out[name] = _layout(tmp, name, recipe, model_dir, batches, checkpoint=checkpoint)
    from transformers import AutoModelForImageTextToText

    out["hf_weights"] = AutoModelForImageTextToText.from_pretrained(model_dir).state_dict()
    return out


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_every_layout_gives_the_single_rank_losses_and_norms(runs, name):
    want = runs["tp1"]["rows"]
    for (loss, norm), (want_loss, want_norm) in zip(runs[name]["rows"], want, strict=True):
        assert loss == pytest.approx(want_loss, rel=1e-6) and norm == pytest.approx(want_norm, rel=1e-5)
    print(f"{name}: {runs[name]['rows']}")


def test_one_megatron_rank_gives_the_hf_backends_losses(runs):
    for (loss, norm), (want_loss, want_norm) in zip(runs["tp1"]["rows"], runs["hf"]["rows"], strict=True):
        assert loss == pytest.approx(want_loss, rel=1e-5) and norm == pytest.approx(want_norm, rel=1e-5)
    print(f"hf: {runs['hf']['rows']}\nmegatron tp=1: {runs['tp1']['rows']}")


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_the_refit_gives_the_hf_models_tensors_bitwise_from_every_layout(runs, name):
    refit, want = runs[name]["refit"], runs["hf_weights"]
    assert sorted(refit) == sorted(want)
    assert all(torch.equal(refit[n], want[n]) for n in want)
    assert runs[name]["same_reference"]  # the reference stage is the policy's initial weights


@pytest.mark.parametrize("name", [n for n in LAYOUTS if n != "tp2pp2"])
def test_a_checkpoint_of_tp2_pp2_resumes_in_every_layout(runs, name):
    want = runs["tp2pp2"]["rows"][1][0]  # its second step, after the checkpoint of its first
    assert runs[name]["resumed"] == pytest.approx(want, rel=1e-6)
    assert set(runs["tp2pp2"]["written"]) >= {
        f"policy/pieces/{p}_{k}.pt" for p in ("model", "optimizer") for k in range(4)
    }
