"""LoRA on the hf policy (`model.lora`), fast: the recipe's checks, the merge, the refit's names, the
reference with the adapters off, the fit check's savings, and a refit engine answering as the policy with
adapters on the vision tower. (Real runs through the CLI: tests/test_lora_runs.py.)"""

from __future__ import annotations

import pytest
import torch
from vlmrun_cli import GRPO, TINY, vlmrun

from vlmrun.config.load import load_recipe
from vlmrun.config.lora import LoraConfig
from vlmrun.config.train import TrainConfig
from vlmrun.errors import InputError
from vlmrun.models.spec import ModelSpec
from vlmrun.policy import open_policy

LORA = ["model.lora.rank=8"]
TOWER = {"rank": 4, "alpha": 8.0, "dropout": 0.0, "targets": "all_linear", "vision": True, "projector": True}


@pytest.mark.parametrize(
    ("overrides", "field", "words"),
    [
        (["model.lora.rank=0"], "model.lora.rank", "greater than or equal to 1"),
        (["model.lora.rank=2.5"], "model.lora.rank", "integer"),
        (["model.lora.rank=5000"], "model.lora.rank", "less than or equal to 4096"),
        ([*LORA, "model.lora.alpha=0"], "model.lora.alpha", "greater than 0"),
        ([*LORA, "model.lora.dropout=1.0"], "model.lora.dropout", "less than 1"),
        ([*LORA, "model.lora.dropout=-0.1"], "model.lora.dropout", "greater than or equal to 0"),
        ([*LORA, "model.lora.targets=qkv"], "model.lora.targets", "'attention', 'mlp' or 'all_linear'"),
        ([*LORA, "model.lora.vision=3"], "model.lora.vision", "boolean"),
        ([*LORA, "model.lora.init=pissa"], "model.lora.init", "'default' or 'gaussian'"),
        ([*LORA, "model.lora.ranks=8"], "model.lora.ranks", "valid keys"),
        ([*LORA, "model.backend=megatron"], "model.lora", "use model.backend: hf for LoRA"),
    ],
)
def test_bad_lora_settings_name_the_field(overrides, field, words):
    with pytest.raises(InputError) as e:
        load_recipe(TINY, overrides)
    msg = str(e.value)
    assert msg.startswith(field) and words in msg, msg


def test_grpo_refuses_adapter_dropout_and_the_cli_exits_2_naming_it():
    with pytest.raises(InputError, match=r"^model.lora.dropout: 0.1 .*probs_ratio exactly 1"):
        load_recipe(GRPO, [*LORA, "model.lora.dropout=0.1"])
    out = vlmrun("submit", TINY, "--cluster", "local", "--dry-run", "--set", "model.lora.targets=qkv", "--set", LORA[0])
    assert out.returncode == 2 and "model.lora.targets" in out.stderr and "Traceback" not in out.stderr


def test_lora_is_in_the_run_identity_and_a_changed_rank_is_refused():
    from vlmrun.config.identity import check_same_identity, run_identity

    saved = run_identity(load_recipe(TINY, LORA), model_contents=None)
    assert (
        saved["model.lora"]["rank"] == 8 and run_identity(load_recipe(TINY), model_contents=None)["model.lora"] is None
    )
    with pytest.raises(InputError, match="model.lora"):
        check_same_identity(
            saved, run_identity(load_recipe(TINY, ["model.lora.rank=4"]), model_contents=None), where="x"
        )


def test_the_fit_check_counts_the_adapters_gradients_and_optimizer_state_and_says_what_it_saved():
    from vlmrun.models.fit import check_memory_fit

    full, lora = (check_memory_fit(load_recipe(GRPO, o + ["grpo.kl_coef=0.1"])).estimate for o in ([], LORA))
    assert lora.gradients * 10 < full.gradients and lora.optimizer * 10 < full.optimizer
    assert full.reference > 0 and lora.reference == 0  # the reference is the base with its adapters off
    said = check_memory_fit(load_recipe(TINY, LORA)).assumption
    assert "LoRA:" in said and "saved" in said


def policy(tiny_dirs, family: str, lora: dict | None, *, seed: int = 1234, parallel=None):
    train = TrainConfig(lr=1e-2, warmup_steps=0, lr_schedule="constant", seed=seed)
    spec = ModelSpec(directory=tiny_dirs[family], lora=LoraConfig(**lora).model_dump() if lora else None)
    p = open_policy("hf", model=spec, rank=0, world_size=1, train=train, parallel=parallel)
    p.setup(master_addr="127.0.0.1", master_port=0, max_steps=4)
    return p


def nudge(model: torch.nn.Module) -> None:
    """Give every adapter's B values, as training would."""
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".lora_B." in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.05)


class TextBatch:
    """A text-only micro-batch as the policy scores it: every token after the first labelled."""

    image_source, is_packed = None, False

    def __init__(self, ids: torch.Tensor):
        self.input_ids, self.labels = ids, ids.clone()

    def model_inputs(self):
        return {"input_ids": self.input_ids, "attention_mask": torch.ones_like(self.input_ids)}


@pytest.mark.parametrize(
    "family",
    ["qwen2_5_vl", *(pytest.param(f, marks=pytest.mark.slow) for f in ("qwen2_vl", "qwen3_vl", "nemotron_omni"))],
)
def test_only_adapters_train_from_the_seed_and_the_refit_merges_them_under_the_base_names(tiny_dirs, family):
    from peft import get_peft_model

    from vlmrun.models.build import build_model
    from vlmrun.policy.lora import base_name, peft_config

    p = policy(tiny_dirs, family, TOWER)
    again = policy(tiny_dirs, family, TOWER)
    base = build_model(ModelSpec(directory=tiny_dirs[family]))
    trained = [n for n, t in p.model.named_parameters() if t.requires_grad]
    assert trained and all(".lora_A." in n or ".lora_B." in n for n in trained)
    assert set(p.checkpoint_state().parts["model"]) == set(trained)  # the checkpoint holds the adapters
    for (n, a), b in zip(p.model.state_dict().items(), again.model.state_dict().values(), strict=True):
        assert torch.equal(a, b), n  # the adapters start from the run's seed
    losses = [again.train_step([TextBatch(torch.arange(5, 25).reshape(2, 10))]).loss for _ in range(3)]
    assert losses[2] < losses[0]
    for name, t in again.model.state_dict().items():  # the base is the directory's, bit for bit
        if ".lora_" not in name:
            assert torch.equal(t, base.state_dict()[base_name(name)]), name
    nudge(p.model)
    merged = {n: t for bucket in p.weights_for_refit(bucket_bytes=16 << 10) for n, t in bucket.items()}
    assert merged.keys() == {n for n in base.state_dict() if n not in tied_later(base)}  # no base_layer, no lora_
    # peft's own merge of the same adapters gives the same bits
    reference = get_peft_model(
        build_model(ModelSpec(directory=tiny_dirs[family])), peft_config(base, TOWER | {"init": "default"})
    )
    reference.load_state_dict({f"base_model.model.{k}": v for k, v in p.model.state_dict().items()}, strict=False)
    want = reference.merge_and_unload().state_dict()
    changed = [n for n in merged if not torch.equal(merged[n], base.state_dict()[n])]
    assert changed and all(torch.equal(merged[n], want[n]) for n in merged)
    p.shutdown()
    again.shutdown()


def test_the_refit_merges_the_layers_that_activation_checkpointing_wraps(tiny_dirs):
    from vlmrun.config.parallel import ParallelConfig

    plain = policy(tiny_dirs, "qwen2_5_vl", TOWER)
    wrapped = policy(tiny_dirs, "qwen2_5_vl", TOWER, parallel=ParallelConfig(dp=1, activation_checkpointing=True))
    for p in (plain, wrapped):
        nudge(p.model)
    want = {n: t for b in plain.weights_for_refit() for n, t in b.items()}
    got = {n: t for b in wrapped.weights_for_refit() for n, t in b.items()}
    assert got.keys() == want.keys() and all(torch.equal(got[n], want[n]) for n in want)
    plain.shutdown()
    wrapped.shutdown()


def tied_later(model) -> set[str]:
    seen, later = set(), set()
    for name, t in model.named_parameters(remove_duplicate=False):
        (later if id(t) in seen else seen).add(name if id(t) in seen else id(t))
    return later


def test_the_reference_is_the_base_with_adapters_off_and_scoring_drops_no_adapter_input(tiny_dirs):
    p = policy(tiny_dirs, "qwen2_5_vl", TOWER | {"dropout": 0.5})
    base = policy(tiny_dirs, "qwen2_5_vl", None)  # every weight, as the directory holds them
    nudge(p.model)
    batch = TextBatch(torch.arange(5, 25).reshape(2, 10))
    assert torch.equal(p.reference_logprobs(batch), base.logprobs(batch))
    first, second = p.logprobs(batch), p.logprobs(batch)  # no adapter dropout while scoring
    assert torch.equal(first, second) and not torch.equal(first, base.logprobs(batch))
    assert all(t.requires_grad for n, t in p.model.named_parameters() if ".lora_" in n)  # trainable again after
    p.shutdown()
    base.shutdown()


@pytest.mark.slow
def test_an_engine_refit_with_tower_adapters_answers_an_image_prompt_as_the_policy_does(tiny_dirs):
    from PIL import Image
    from transformers import AutoProcessor

    from vlmrun.algorithms.common.refit import refit
    from vlmrun.data.batch import PromptBatch
    from vlmrun.generation import open_generator
    from vlmrun.generation.interface import SamplingParams
    from vlmrun.policy.lora import adapters_off

    d = tiny_dirs["qwen2_5_vl"]
    p = policy(tiny_dirs, "qwen2_5_vl", TOWER)
    nudge(p.model)
    processor = AutoProcessor.from_pretrained(d)
    message = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "how many cubes?"}]}]
    text = processor.apply_chat_template(message, add_generation_prompt=True)
    images = [Image.new("RGB", (112, 112), c) for c in ((200, 30, 30), (20, 90, 220))]
    enc = processor(text=[text, text], images=images, return_tensors="pt", padding=True, padding_side="left")
    media = {"pixel_values": enc["pixel_values"], "image_grid_thw": enc["image_grid_thw"]}
    prompts = PromptBatch(["a", "b"], enc["input_ids"], enc["attention_mask"], ["1", "2"], media=media)
    greedy = SamplingParams(temperature=0, max_new_tokens=6)
    engine = open_generator("hf", model=ModelSpec(directory=d), weights="refit")
    engine.setup()
    refit(engine, p, bucket_bytes=16 << 10)
    own = open_generator("hf", model=ModelSpec(directory=d), weights="policy", policy_model=p.model)
    own.setup()
    got, want = engine.generate(prompts, greedy, n=1), own.generate(prompts, greedy, n=1)
    assert torch.equal(got.response_ids, want.response_ids)
    assert torch.allclose(got.logprobs, want.logprobs, atol=1e-5)
    with adapters_off(p.model):  # the tower's adapters matter: the base's engine answers otherwise
        base = own.generate(prompts, greedy, n=1)
    assert not torch.equal(base.logprobs, want.logprobs)
    engine.shutdown()
    own.shutdown()
    p.shutdown()
