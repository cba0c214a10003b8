"""The megatron backend through the CLI, as a user runs it: `vlmrun submit ... --set model.backend=megatron`.

SFT: a tp=2 run of 6 steps (`tp2`, one replica of 2 ranks) against the hf backend at dp=1 (to 1e-5),
the v1 loop (bitwise), a SIGKILL at a random step and its resume (bitwise), a run stopped at step 4 and
resumed at tp=1 x pp=2 (the data order carries on: within 1e-5); packed rows at pp=2 (to 1e-5 of the
padded run); 2 replicas x tp=2 (4 ranks) against the hf run at dp=2 (`sft_baseline`); the export of the
tp=2 run loads in transformers with the megatron model's log-probs. A layout change with the data order
restarted: tests/test_fsdp_runs.py (the same resume path). GRPO: tests/test_megatron_grpo.py.
"""

from __future__ import annotations

import os
import random
import signal

import pytest
from data_samples import free_port, start_ranks
from shared_runs import submit, submit_args
from vlmrun_cli import Launcher, job, last_step, node_pid, rows, same_history, sealed, sets, vlmrun, wait_for

from vlmrun.run.metrics import history

pytestmark = pytest.mark.slow  # real runs through the CLI, 2-4 ranks each
SFT = ["train.max_steps=6", "checkpoint.save_period=2", "train.val_samples=8", "train.val_period=3", "parallel.dp=1"]
MEGATRON = ["model.backend=megatron", "parallel.tp=2"]


@pytest.fixture(scope="module")
def sft(run_data) -> list[str]:
    return [*run_data, *sets(*SFT)]


@pytest.fixture(scope="module")
def tp2(tmp_path_factory, sft):
    """The uninterrupted tp=2 run every other megatron SFT run is compared with."""
    return submit(tmp_path_factory.mktemp("tp2") / "run", *sft, *sets(*MEGATRON))


def _close(got: dict, want: dict, steps, rel: float) -> None:
    for step in steps:
        for key in ("loss", "grad_norm"):
            assert got[step][key] == pytest.approx(want[step][key], rel=rel), (step, key)
        assert got[step]["sample_ids"] == want[step]["sample_ids"]


def test_tp2_gives_the_hf_backends_losses_at_dp_1(tmp_path, tp2, sft):
    hf = submit(tmp_path / "hf", *sft)
    got, want = history(tp2 / "metrics.jsonl"), history(hf / "metrics.jsonl")
    _close(got, want, range(1, 7), 1e-5)
    assert got[6]["val_loss"] == pytest.approx(want[6]["val_loss"], rel=1e-5)
    assert job(tp2)["attempts"][0]["policy_layout"] == "megatron-core: 1 replica(s) x tp=2 x pp=1"
    print({s: (got[s]["loss"], want[s]["loss"]) for s in got})


def test_the_v1_loop_gives_the_v2_runs_numbers_bitwise(tmp_path, tp2, sft):
    same_history(submit(tmp_path / "v1", *sft, *sets(*MEGATRON, "train.loop=v1")), tp2)


def test_a_sigkill_at_a_random_step_and_a_resume_give_the_uninterrupted_history_bitwise(tmp_path, tp2, sft):
    run = tmp_path / "killed"
    launcher = Launcher(tmp_path, *submit_args(run, *sft, *sets(*MEGATRON)), name="submit")
    node = node_pid(run)
    at = random.Random().randint(2, 5)
    wait_for(lambda: last_step(run) >= at, 300, f"step {at}", poll=0.01)
    os.kill(node, signal.SIGKILL)
    launcher.wait(120)
    print(f"killed at step {last_step(run)}, checkpoints sealed: {sealed(run)}")
    out = vlmrun("resume", str(run), "--wait")
    assert out.returncode == 0, out.stderr[-3000:]
    same_history(run, tp2)


def test_a_resume_at_another_tp_and_pp_continues_the_run(tmp_path, tp2, sft):
    run = tmp_path / "relayout"
    out = vlmrun(*submit_args(run, *sft, *sets(*MEGATRON, "train.stop_after=4")))
    assert out.returncode == 3, out.stderr[-3000:]  # stopped at a checkpoint
    out = vlmrun("resume", str(run), "--wait", *sets("parallel.tp=1", "parallel.pp=2"))
    assert out.returncode == 0, out.stderr[-3000:]
    assert "parallel.pp: 1 -> 2: the model and optimizer state are read into the new tp x pp" in out.stdout + out.stderr
    got = {r["step"]: r for r in rows(run) if r["attempt"] == 1}
    _close(got, history(tp2 / "metrics.jsonl"), (5, 6), 1e-5)


def test_packed_rows_through_two_pipeline_stages_give_the_padded_runs_losses(tmp_path, tp2, sft):
    run = submit(tmp_path / "packed", *sft, *sets("model.backend=megatron", "parallel.pp=2", "data.pack_tokens=512"))
    _close(history(run / "metrics.jsonl"), history(tp2 / "metrics.jsonl"), range(1, 7), 1e-5)


def test_two_replicas_of_two_tensor_parallel_ranks_give_the_hf_runs_losses(tmp_path, sft_sets, sft_baseline):
    run = tmp_path / "dp2tp2"
    out = vlmrun(*submit_args(run, *sft_sets, *sets(*MEGATRON, "cluster.cpus_per_node=4", "train.stop_after=4")))
    assert out.returncode == 3, out.stderr[-3000:]
    got, want = history(run / "metrics.jsonl"), history(sft_baseline / "metrics.jsonl")
    _close(got, want, range(1, 5), 1e-5)


def _megatron_logprobs(rank, run, model_dir, step, out):
    """The megatron model of `run`'s checkpoint `step`, one rank: its log-probs of 3 val samples."""
    import torch
    from data_samples import val_batch

    from vlmrun.checkpoint.parts import MODEL_PART, PolicyState
    from vlmrun.checkpoint.read import Checkpoint, verify
    from vlmrun.checkpoint.store import CheckpointStore
    from vlmrun.models.spec import ModelSpec
    from vlmrun.policy import open_policy
    from vlmrun.run.directory import RunDirectory

    recipe = RunDirectory(run).load_recipe()
    path = dict(CheckpointStore(RunDirectory(run).checkpoints(recipe), keep=2).complete())[step]
    policy = open_policy("megatron", model=ModelSpec(directory=model_dir), rank=0, world_size=1, train=recipe.train)
    policy.setup(master_addr="127.0.0.1", master_port=free_port(), max_steps=step, weights="checkpoint")
    state = PolicyState(policy.checkpoint_state().storage, {MODEL_PART: None})
    policy.load_checkpoint_state(Checkpoint(step, path, verify(path)).read_policy(state))
    torch.save(policy.logprobs(val_batch(run, model_dir)), out)
    policy.shutdown()
    os._exit(0)


def test_the_export_of_a_megatron_run_loads_in_transformers_with_the_megatron_models_logprobs(tmp_path, tp2):
    import torch
    from data_samples import val_batch
    from transformers import AutoModelForImageTextToText

    from vlmrun.policy.loss import token_logprobs

    out = vlmrun("export", str(tp2), str(tmp_path / "model"))
    assert out.returncode == 0, out.stderr[-3000:]
    model = AutoModelForImageTextToText.from_pretrained(tmp_path / "model").eval()
    batch = val_batch(tp2, str(tmp_path / "model"))
    with torch.no_grad():
        hf = token_logprobs(model(**batch.model_inputs()).logits, batch.labels)
    start_ranks(_megatron_logprobs, (tp2, str(tmp_path / "model"), 6, tmp_path / "lp.pt"), 1)
    megatron = torch.load(tmp_path / "lp.pt")
    labelled = batch.labels[:, 1:] != -100
    assert torch.allclose(hf[labelled], megatron[labelled], rtol=1e-5, atol=1e-5)
