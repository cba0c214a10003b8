"""What the rank sends the vllm engine and what it makes of the answers: plain values, no vLLM, no engine.

The requests (`engine_prompts`, `sampling_options`, seeded per response by `response_seed`) and the
`Rollouts` of the engine's draws (`rollouts_from`), as the `vllm` backend (vllm.py, whose module doc says
why each is as it is) and the GPU check (tools/gpu/vllm_check.py) build them. Not a backend module:
anything may import it.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import Any

from vlmrun.data.batch import PromptBatch
from vlmrun.generation.interface import SamplingParams
from vlmrun.generation.prompts import ROWS_KEY, prompt_media
from vlmrun.generation.rollouts import Rollouts, response_mask
from vlmrun.generation.special_tokens import SpecialTokens

NEVER_BIAS = -100.0


def collapse_placeholders(ids: Sequence[int], token: int) -> list[int]:
    """`ids` with every run of `token` shortened to one (vllm.py's module doc)."""
    out: list[int] = []
    for t in ids:
        if not (t == token and out and out[-1] == token):
            out.append(int(t))
    return out


def response_seed(seed: int, call: int, sample_id: str, response: int) -> int:
    """A 63-bit seed for response `response` to prompt `sample_id` in sampling call `call` of a run
    seeded `seed` (vllm.py's module doc): distinct inputs give unrelated seeds."""
    key = f"{seed}\0{call}\0{sample_id}\0{response}".encode()
    return int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "little") >> 1


def engine_prompts(prompts: PromptBatch, image_token_id: int | None) -> list[dict[str, Any]]:
    """One engine prompt per row of `prompts` (vllm.py's module doc): {"ids"}, and {"pixels" (float32 numpy
    rows), "grid" (one [t, h, w] per image)} for a prompt with images."""
    media = prompt_media(prompts, image_token_id)
    out = []
    for i in range(len(prompts)):
        ids = prompts.input_ids[i][prompts.attention_mask[i].bool()].tolist()
        prompt: dict[str, Any] = {"ids": ids}
        if media[i]:
            grid = next(v for k, v in media[i].items() if k != ROWS_KEY)
            prompt = {
                "ids": collapse_placeholders(ids, image_token_id),
                "pixels": media[i][ROWS_KEY].float().numpy(),
                "grid": grid.tolist(),
            }
        out.append(prompt)
    return out


def sampling_options(sampling: SamplingParams, seed: int | None, tokens: SpecialTokens) -> dict[str, Any]:
    """vLLM's SamplingParams arguments for one response (n=1) drawn with `seed` (None: greedy)."""
    return {
        "n": 1,
        "temperature": sampling.temperature if seed is not None else 0.0,
        "top_p": sampling.top_p if seed is not None else 1.0,
        "top_k": 0,  # no top-k: SamplingParams has none
        "max_tokens": sampling.max_new_tokens,
        "seed": seed,
        "logprobs": 0,  # the sampled token's own
        "stop_token_ids": list(tokens.eos_ids),
        "logit_bias": {t: NEVER_BIAS for t in tokens.never_generated} or None,
        "detokenize": False,
        "skip_special_tokens": False,
    }


def rollouts_from(
    drawn: Sequence[tuple[Sequence[int], Sequence[float]]],
    batch: PromptBatch,
    *,
    n: int,
    tokens: SpecialTokens,
    generate_s: float,
) -> Rollouts:
    """The `Rollouts` of the engine's draws ((token ids, log-probs) each), one per row of `batch` (the
    prompts each repeated n times), in order: response ids right-padded, the mask up to the first
    end-of-turn token. Each tensor is built from padded lists at once, not token by token."""
    import torch

    if len(drawn) != len(batch):
        raise ValueError(f"the engine answered {len(drawn)} requests of {len(batch)}")
    for row, (ids, logprobs) in enumerate(drawn):
        if len(logprobs) != len(ids):
            raise ValueError(f"request {row}: the engine returned no log-prob for each sampled token")
    width = max(1, max(len(ids) for ids, _ in drawn))
    pad = tokens.pad_token_id
    ids = torch.tensor([list(i) + [pad] * (width - len(i)) for i, _ in drawn], dtype=torch.long)
    logprobs = torch.tensor([list(lp) + [0.0] * (width - len(lp)) for _, lp in drawn], dtype=torch.float32)
    lengths = torch.tensor([len(i) for i, _ in drawn])
    drew = torch.arange(width)[None, :] < lengths[:, None]  # the padding is not a token (its id may be an eos id)
    mask = response_mask(ids, tokens.eos_ids) * drew
    return Rollouts.sampled(
        batch, n=n, response_ids=ids, mask=mask, logprobs=logprobs, pad_token_id=pad, generate_s=generate_s
    )
