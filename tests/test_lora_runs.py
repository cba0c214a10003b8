"""LoRA runs through the CLI on the tiny recipes (model.lora.rank=8): an SFT run SIGKILLed once it sealed a
checkpoint and resumed equals, at every step and bit for bit, an uninterrupted run of the other loop (v1)
sharded with FSDP2; its checkpoints hold the adapters only, smaller than a full run's by about the ratio
of parameters; its exports (merged, and --adapter loaded by peft onto the base) give the trained policy's
logits; GRPO with adapters on the vision tower too, from that merged export, keeps probs_ratio at exactly
1 with a KL to the base that is 0 at step 1 and then grows. (Fast checks: tests/test_lora.py.)
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from shared_runs import submit
from vlmrun_cli import GRPO, TINY, Launcher, same_history, sealed, sets, states, vlmrun, wait_for

from vlmrun.run.metrics import history

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

STEPS = 8
LORA_SFT = ["model.lora.rank=8", f"train.max_steps={STEPS}", "checkpoint.save_period=3"]
LORA_SFT += ["train.val_samples=0", "data.num_workers=0"]


@pytest.fixture(scope="module")
def killed(tmp_path_factory, run_data) -> Path:
    """The recipe's loop (v2, replicated on dp=2) SIGKILLed once it sealed step 3's checkpoint, resumed."""
    folder = tmp_path_factory.mktemp("lora-killed")
    run = folder / "run"
    args = ["submit", TINY, "--cluster", "local", "--run-dir", str(run), *run_data, *sets(*LORA_SFT), "--wait"]
    launcher = Launcher(folder, *args, name="attempt-0")
    try:
        ended = launcher.proc.poll
        wait_for(lambda: 3 in sealed(run) or ended() is not None, 300, "the checkpoint of step 3")
        assert 3 in sealed(run), launcher.stderr()[-3000:]
    finally:
        launcher.kill_group()
        launcher.proc.wait()
    out = vlmrun("resume", str(run), "--wait")
    assert out.returncode == 0, out.stderr[-3000:]
    return run


@pytest.fixture(scope="module")
def straight(tmp_path_factory, run_data) -> Path:
    """The same run uninterrupted, on the other loop (v1) and sharded (FSDP2 over the adapters and the base)."""
    folder = tmp_path_factory.mktemp("lora-straight")
    return submit(folder / "run", *run_data, *sets(*LORA_SFT, "train.loop=v1", "parallel.fsdp=true"))


def test_lora_sft_killed_and_resumed_equals_an_uninterrupted_sharded_v1_run(killed, straight):
    same_history(killed, straight)
    assert states(killed) == ["KILLED", "COMPLETED"]
    rows = history(killed / "metrics.jsonl")
    assert sorted(rows) == list(range(1, STEPS + 1)) and rows[STEPS]["loss"] < rows[1]["loss"] - 0.3
    held = torch.load(killed / "checkpoints" / f"step_{STEPS}" / "policy" / "model.pt", weights_only=True)
    assert held and all(".lora_A." in k or ".lora_B." in k for k in held)  # the base is never written


def test_a_lora_checkpoint_is_smaller_than_a_full_one_by_about_the_ratio_of_parameters(killed, finished_run):
    def policy(run: Path) -> tuple[int, int]:
        step = max(int(p.name.split("_")[1]) for p in (run / "checkpoints").glob("step_*"))
        folder = run / "checkpoints" / f"step_{step}" / "policy"
        params = sum(t.numel() for t in torch.load(folder / "model.pt", weights_only=True).values())
        return sum(f.stat().st_size for f in folder.rglob("*") if f.is_file()), params

    (lora_bytes, adapters), (full_bytes, every) = policy(killed), policy(finished_run)
    ratio = adapters / every
    assert ratio < 0.1 and 0.5 * ratio < lora_bytes / full_bytes < 2 * ratio + 0.02


def model_inputs(model_dir: Path) -> dict[str, torch.Tensor]:
    """Two image questions as the tiny model's processor encodes them."""
    from PIL import Image
    from transformers import AutoProcessor

    processor = AutoProcessor.from_pretrained(model_dir)
    message = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "how many cubes?"}]}]
    text = processor.apply_chat_template(message, add_generation_prompt=True)
    images = [Image.new("RGB", (112, 112), c) for c in ((200, 30, 30), (20, 90, 220))]
    return dict(processor(text=[text, text], images=images, return_tensors="pt", padding=True))


@pytest.fixture(scope="module")
def exports(tmp_path_factory, killed) -> Path:
    """`vlmrun export` of the resumed run's last checkpoint: merged/ and, with --adapter, adapter/."""
    folder = tmp_path_factory.mktemp("lora-exports")
    for args, out in ((["--adapter"], folder / "adapter"), ([], folder / "merged")):
        done = vlmrun("export", str(killed), str(out), *args)
        assert done.returncode == 0 and "Warning" not in done.stderr, done.stderr[-2000:]
    return folder


def test_merged_and_adapter_exports_give_the_trained_policy_logits_and_the_base_is_unchanged(killed, exports):
    from peft import PeftModel
    from transformers import AutoModelForImageTextToText

    from vlmrun.config.lora import LoraConfig
    from vlmrun.policy.lora import add_adapters

    base_dir = Path(json.loads((exports / "merged" / "vlmrun_export.json").read_text())["model_dir"])
    trained = AutoModelForImageTextToText.from_pretrained(base_dir)
    add_adapters(trained, LoraConfig(rank=8).model_dump())
    held = torch.load(killed / "checkpoints" / f"step_{STEPS}" / "policy" / "model.pt", weights_only=True)
    assert not trained.load_state_dict(held, strict=False).unexpected_keys
    inputs = model_inputs(base_dir)
    merged = AutoModelForImageTextToText.from_pretrained(exports / "merged")
    peft = PeftModel.from_pretrained(AutoModelForImageTextToText.from_pretrained(base_dir), exports / "adapter")
    base = AutoModelForImageTextToText.from_pretrained(base_dir)
    with torch.no_grad():
        want = trained(**inputs).logits
        for model in (merged, peft):
            assert torch.allclose(model(**inputs).logits, want, atol=1e-5, rtol=0)
        assert not torch.allclose(base(**inputs).logits, want, atol=1e-3)  # the adapters changed the answers
    kept = {n: t for n, t in merged.state_dict().items() if not n.endswith("proj.weight")}  # not adapted
    assert all(torch.equal(t, base.state_dict()[n]) for n, t in kept.items())
    for name, t in peft.named_parameters():  # the base under the adapters: the directory's bits
        if ".base_layer." in name:
            assert torch.equal(t, base.get_parameter(name.replace("base_model.model.", "").replace(".base_layer", "")))


@pytest.fixture(scope="module")
def grpo_run(tmp_path_factory, exports, run_data) -> Path:
    """GRPO from the LoRA SFT run's merged export, adapters on the vision tower and projector too, KL
    to the base in the loss."""
    folder = tmp_path_factory.mktemp("lora-grpo")
    small = ["train.global_batch_size=8", "grpo.num_generations=4", "train.max_steps=4", "train.val_samples=0"]
    lora = ["model.lora.rank=8", "model.lora.vision=true", "model.lora.projector=true", "grpo.kl_coef=0.05"]
    policy = ["model.tiny=false", f"model.path={exports / 'merged'}", "train.lr=1e-3", "checkpoint.save_period=4"]
    return submit(folder / "run", *run_data, *sets(*small, *lora, *policy), recipe=GRPO)


def test_lora_grpo_keeps_the_ratio_at_1_and_its_kl_to_the_base_starts_at_0_and_grows(grpo_run):
    rows = history(grpo_run / "metrics.jsonl")
    assert sorted(rows) == [1, 2, 3, 4]
    assert all(r["probs_ratio_min"] == r["probs_ratio_max"] == 1.0 for r in rows.values())
    kl = [rows[s]["kl"] for s in sorted(rows)]
    assert kl[0] == 0.0 and 0 < kl[1] < kl[-1]
    # the engine takes merged weights: what it samples from is the policy's distribution
    assert all(abs(r["token_mult_prob_error"] - 1) < 1e-4 for r in rows.values())
