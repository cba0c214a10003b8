"""Offline byte-level BPE tokenizers for the tiny model families.

The vocabulary is trained with `tokenizers` on synthetic CLEVR-style questions and answers, so a tiny
model needs no download. Training is deterministic and does not depend on the model's seed: every tiny
model of one family shares the same token ids, so data cooked for one seed is valid for all of them
(the three Qwen families share one spec too: models/tiny/qwen.py). The data sets themselves hold
images and text only, so one set serves every family.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from vlmrun.datasets import clevr_scene

# The synthetic CLEVR set's words (datasets/clevr_scene.py), so its questions tokenize to whole words.
COLORS = tuple(clevr_scene.COLORS)
SHAPES = clevr_scene.SHAPES
SIZES = clevr_scene.SIZES
MAX_COUNT = 10

# Qwen2's pre-tokenizer split: one token per digit, words keep their leading space.
_SPLIT_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_ROLES = ("system", "user", "assistant")
_CORPUS_SEED = 1234
_CORPUS_SIZE = 4000


@dataclass(frozen=True, kw_only=True)
class TokenizerSpec:
    """The tokens a family's tokenizer must hold besides the trained BPE vocabulary.

    `special_tokens` get the lowest ids, in order, and are dropped by `decode(skip_special_tokens=True)`;
    `added_tokens` are never split but survive decoding (e.g. `<think>`).
    """

    special_tokens: tuple[str, ...]
    added_tokens: tuple[str, ...] = ()
    eos_token: str
    pad_token: str
    unk_token: str | None = None
    bos_token: str | None = None
    vocab_size: int = 512


def _plural(shape: str) -> str:
    return shape + "s"


def _question_and_answer(rng: random.Random) -> tuple[str, str]:
    color, shape, size = rng.choice(COLORS), rng.choice(SHAPES), rng.choice(SIZES)
    count = str(rng.randint(0, MAX_COUNT))
    yes_no = rng.choice(("yes", "no"))
    templates = (
        (f"How many {color} {_plural(shape)} are there?", count),
        (f"How many {_plural(shape)} are there?", count),
        (f"How many {size} {color} objects are there?", count),
        ("How many objects are there?", count),
        (f"Count the {color} objects.", count),
        (f"Is there a {color} {shape}?", yes_no),
        (f"Are there any {size} {_plural(shape)}?", yes_no),
        (f"Is the {shape} {color}?", yes_no),
        (f"What color is the {size} {shape}?", color),
        (f"What shape is the {color} object?", shape),
        (f"Are there more {_plural(shape)} than {color} objects?", yes_no),
    )
    return rng.choice(templates)


def clevr_corpus(num_strings: int = _CORPUS_SIZE, *, seed: int = _CORPUS_SEED) -> list[str]:
    """Synthetic CLEVR-style strings: questions, bare answers, and answer sentences."""
    rng = random.Random(seed)
    corpus = [str(n) for n in range(MAX_COUNT + 1)] + ["yes", "no", "Yes", "No", "objects"]
    corpus += list(COLORS) + list(SHAPES) + [_plural(s) for s in SHAPES]
    corpus += [f"{role}\n" for role in _ROLES] + ["You are a helpful assistant."]
    while len(corpus) < num_strings:
        question, answer = _question_and_answer(rng)
        role = rng.choice(_ROLES)
        # chat turns put the answer right after the role header, with no leading space
        corpus += [question, answer, f"{role}\n{question}", f"{role}\n{answer}", f"The answer is {answer}."]
    return corpus[:num_strings]


def train_tokenizer(spec: TokenizerSpec):
    """Train the byte-level BPE of `spec` and wrap it in a `PreTrainedTokenizerFast`.

    Deterministic: the same spec gives the same vocabulary and merges in any process.
    """
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.BPE(unk_token=None, byte_fallback=False))
    backend.normalizer = normalizers.NFC()
    backend.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(_SPLIT_PATTERN), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=spec.vocab_size,
        min_frequency=2,
        special_tokens=list(spec.special_tokens),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    backend.train_from_iterator(clevr_corpus(), trainer=trainer)
    named = {"eos_token": spec.eos_token, "pad_token": spec.pad_token}
    if spec.unk_token is not None:
        named["unk_token"] = spec.unk_token
    if spec.bos_token is not None:
        named["bos_token"] = spec.bos_token
    extra = [t for t in spec.special_tokens if t not in named.values()]
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        extra_special_tokens=extra,
        model_max_length=4096,
        padding_side="right",
        clean_up_tokenization_spaces=False,
        **named,
    )
    if spec.added_tokens:
        tokenizer.add_tokens(list(spec.added_tokens), special_tokens=False)
    return tokenizer


# ChatML as every tiny family renders it; chatml_template fills in the <<...>> markers.
_CHATML = """\
{%- for message in messages -%}
  {{- '<|im_start|>' + message['role'] + '\\n' -}}
  {%- if message['role'] == 'assistant' -%}
    {{- '<<THINK>>' -}}
    {%- generation -%}
      {%- if message['content'] is string -%}{{- message['content'] -}}
      {%- else -%}
        {%- for part in message['content'] if part['type'] == 'text' -%}{{- part['text'] -}}{%- endfor -%}
      {%- endif -%}
      {{- '<|im_end|>' -}}
    {%- endgeneration -%}
    {{- '\\n' -}}
  {%- else -%}
    {%- if message['content'] is string -%}{{- message['content'] -}}
    {%- else -%}
      {%- for part in message['content'] -%}
        {%- if part['type'] == 'image' -%}{{- '<<IMAGE>>' -}}
        {%- elif part['type'] == 'video' -%}{{- '<<VIDEO>>' -}}
        {%- elif part['type'] == 'text' -%}{{- part['text'] -}}
        {%- endif -%}
      {%- endfor -%}
    {%- endif -%}
    {{- '<|im_end|>\\n' -}}
  {%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n<<THINK>>' -}}{%- endif -%}
"""


def chatml_template(*, image: str, video: str, think: str = "") -> str:
    """The ChatML chat template of a tiny family: no default system prompt (it would double a tiny
    sample's length), the assistant's answer and its <|im_end|> inside {% generation %} (for assistant
    masks). `image` / `video`: what a media part of a user turn renders as (Jinja string text); `think`
    opens every assistant turn and the generation prompt (Nemotron's empty `<think></think>`)."""
    template = _CHATML if think else _CHATML.replace("    {{- '<<THINK>>' -}}\n", "")
    return template.replace("<<THINK>>", think).replace("<<IMAGE>>", image).replace("<<VIDEO>>", video)
