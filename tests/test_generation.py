"""Generation for GRPO with both tiny families: seeded sampling, G responses per prompt with their media,
log-probs that equal a teacher-forced training forward, refit from new weights, the sampling stream in a
checkpoint."""

from __future__ import annotations

import pytest
import torch
from data_samples import FAMILIES, read_raw_samples

from vlmrun.config.families import family_spec
from vlmrun.data.chat_encoding import ConversationEncoder
from vlmrun.data.cookers import cook_conversation
from vlmrun.data.loader import load_processor
from vlmrun.generation import open_generator
from vlmrun.generation.interface import GenerationBackend, SamplingParams
from vlmrun.generation.prompts import select_prompts
from vlmrun.generation.rollouts import Rollouts, response_mask
from vlmrun.models.spec import ModelSpec
from vlmrun.policy.loss import token_logprobs

pytestmark = pytest.mark.slow  # tiny models generate: seconds per test on busy CPUs

KEYS = ("train-0000000", "train-0000001", "train-0000002")
SAMPLING = SamplingParams(temperature=1.0, top_p=1.0, max_new_tokens=12, seed=7)


@pytest.fixture(scope="module")
def raw(clevr_set):
    return read_raw_samples(clevr_set, "train")


@pytest.fixture(scope="module", params=FAMILIES)
def family(request) -> str:
    return request.param


@pytest.fixture(scope="module")
def prompts(family, raw, tiny_dirs):
    """(encoded prompts, their left-padded batch) of three CLEVR questions with one image each."""
    encoder = ConversationEncoder(load_processor(tiny_dirs[family], family), family_spec(family), max_seq_len=256)
    encoded = [encoder.encode_prompt(cook_conversation(raw[k])) for k in KEYS]
    return encoded, encoder.collate_prompts(encoded)


def generator(model_dir: str, replica: int = 0) -> GenerationBackend:
    g = open_generator("hf", model=ModelSpec(directory=model_dir), replica=replica)
    g.setup()
    return g


def same(a: Rollouts, b: Rollouts) -> bool:
    return (
        a.sample_ids == b.sample_ids
        and torch.equal(a.response_ids, b.response_ids)
        and torch.equal(a.response_mask, b.response_mask)
        and torch.equal(a.logprobs, b.logprobs)
    )


def eos_leaning_weights(g: GenerationBackend, batch) -> dict[str, torch.Tensor]:
    """The model's weights with the end-of-turn logit raised by ~4.5 on typical hidden states, so responses
    end at varied lengths (an untrained model almost never stops)."""
    head = next(m for name, m in g.model.named_modules() if name.endswith("lm_head"))
    seen = []
    hook = head.register_forward_pre_hook(lambda module, args: seen.append(args[0].detach()))
    with torch.no_grad():
        g.model(**batch.model_inputs(), use_cache=False)
    hook.remove()
    mean = seen[0][batch.attention_mask.bool()].mean(dim=0)
    weights = {k: v.clone() for k, v in g.model.state_dict().items()}
    key = next(k for k in weights if k.endswith("lm_head.weight"))
    weights[key][g.eos_ids[0]] += 4.5 * mean / (mean @ mean)
    return weights


def test_select_prompts_repeats_each_prompt_with_its_own_media(family, prompts, tiny_dirs):
    encoded, batch = prompts
    g = generator(tiny_dirs[family])
    rows = [0, 0, 2, 1, 1]
    picked = select_prompts(batch, rows, g.image_token_id)
    assert picked.sample_ids == [KEYS[r] for r in rows] and torch.equal(picked.input_ids, batch.input_ids[rows])
    for k in family_spec(family).media_keys:
        assert torch.equal(picked.media[k], torch.cat([encoded[r].media[k] for r in rows]))
    for k in family_spec(family).token_keys:
        assert torch.equal(picked.token_inputs[k], batch.token_inputs[k][rows])


def test_response_mask_covers_tokens_up_to_the_first_end_of_turn():
    ids = torch.tensor([[5, 6, 2, 0, 0], [5, 2, 7, 2, 0], [5, 6, 7, 8, 9]])
    assert response_mask(ids, [2]).tolist() == [[1, 1, 1, 0, 0], [1, 1, 0, 0, 0], [1, 1, 1, 1, 1]]


def test_same_seed_same_responses_g_per_prompt(family, prompts, tiny_dirs):
    _, batch = prompts
    a, b = generator(tiny_dirs[family]), generator(tiny_dirs[family])
    first, again = a.generate(batch, SAMPLING, n=3), b.generate(batch, SAMPLING, n=3)
    assert same(first, again)
    assert len(first) == 9 and first.sample_ids == [k for k in KEYS for _ in range(3)]
    assert first.answers == [p for p in batch.answers for _ in range(3)]
    # the three responses to one prompt are three draws, and the next call continues the stream
    assert not torch.equal(first.response_ids[0], first.response_ids[1])
    assert not same(first, a.generate(batch, SAMPLING, n=3))
    other_seed = SamplingParams(temperature=1.0, top_p=1.0, max_new_tokens=12, seed=8)
    assert not same(first, b.generate(batch, other_seed, n=3))


def test_greedy_and_a_tiny_top_p_equal_transformers_greedy(family, prompts, tiny_dirs):
    from transformers import AutoModelForImageTextToText

    _, batch = prompts
    model = AutoModelForImageTextToText.from_pretrained(tiny_dirs[family]).eval()
    with torch.no_grad():  # the saved generation config: greedy, placeholders suppressed
        want = model.generate(**batch.model_inputs(), max_new_tokens=6)[:, batch.input_ids.shape[1] :]
    g = generator(tiny_dirs[family])
    for sampling in (SamplingParams(temperature=0, max_new_tokens=6), SamplingParams(top_p=1e-6, max_new_tokens=6)):
        got = g.generate(batch, sampling, n=1)
        assert torch.equal(got.response_ids, want.masked_fill(got.response_mask == 0, got.pad_token_id))


def test_greedy_answers_between_samplings_leave_the_sampling_stream_as_it_was(family, prompts, tiny_dirs):
    """Validation answers greedily between GRPO steps: the responses of the next step must not change."""
    _, batch = prompts
    plain, validated = generator(tiny_dirs[family]), generator(tiny_dirs[family])
    plain.generate(batch, SAMPLING, n=2)
    validated.generate(batch, SAMPLING, n=2)
    validated.generate(batch, SamplingParams(temperature=0, max_new_tokens=4, seed=99), n=1)
    assert validated.state_dict()["seed"] == SAMPLING.seed
    assert same(plain.generate(batch, SAMPLING, n=2), validated.generate(batch, SAMPLING, n=2))


def test_logprobs_equal_a_teacher_forced_forward(family, prompts, tiny_dirs):
    _, batch = prompts
    g = generator(tiny_dirs[family])
    g.load_weights(eos_leaning_weights(g, batch))
    rollouts = g.generate(batch, SAMPLING, n=4)
    lengths = rollouts.response_mask.sum(dim=1)
    assert lengths.min() < SAMPLING.max_new_tokens and lengths.max() > 1, lengths  # some end early, some later
    train = rollouts.training_batch()
    with torch.no_grad():
        teacher = rollouts.response_logprobs(
            token_logprobs(g.model(**train.model_inputs(), use_cache=False).logits, train.labels)
        )
    mask = rollouts.response_mask.bool()
    diff = (teacher - rollouts.logprobs).abs()[mask]
    print(
        f"{family}: {int(mask.sum())} tokens, max |diff| {diff.max():.2e}, median exp(|diff|) {float(diff.exp().median()):.9f}"
    )
    assert diff.max() < 1e-5
    assert (rollouts.logprobs[~mask] == 0).all() and (teacher[~mask] == 0).all()


def test_refit_changes_outputs_and_equals_a_backend_built_from_the_new_weights(family, prompts, tiny_dirs, tmp_path):
    from transformers import AutoModelForImageTextToText

    _, batch = prompts
    g = generator(tiny_dirs[family])
    state = g.state_dict()
    before = g.generate(batch, SAMPLING, n=2)
    weights = eos_leaning_weights(g, batch)
    g.load_weights(weights)
    g.load_state_dict(state)
    after = g.generate(batch, SAMPLING, n=2)
    assert not same(before, after)

    model = AutoModelForImageTextToText.from_pretrained(tiny_dirs[family])
    model.load_state_dict(weights)
    model.save_pretrained(tmp_path / "refit")
    fresh = generator(str(tmp_path / "refit"))
    assert same(after, fresh.generate(batch, SAMPLING, n=2))


def test_sampling_stream_resumes_from_its_saved_state(family, prompts, tiny_dirs, tmp_path):
    _, batch = prompts
    g = generator(tiny_dirs[family])
    g.generate(batch, SAMPLING, n=2)
    torch.save(g.state_dict(), tmp_path / "generation.pt")
    want = g.generate(batch, SAMPLING, n=2)
    resumed = generator(tiny_dirs[family])
    resumed.load_state_dict(torch.load(tmp_path / "generation.pt", weights_only=True))
    assert same(want, resumed.generate(batch, SAMPLING, n=2))


def test_each_replica_samples_its_own_stream(family, prompts, tiny_dirs):
    _, batch = prompts
    first = generator(tiny_dirs[family], replica=0).generate(batch, SAMPLING, n=2)
    assert same(first, generator(tiny_dirs[family], replica=0).generate(batch, SAMPLING, n=2))
    assert not same(first, generator(tiny_dirs[family], replica=1).generate(batch, SAMPLING, n=2))
