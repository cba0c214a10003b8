"""A step's rollouts as the samples the generation stage writes (fields.py, GENERATION), written once.

1. Two kinds of sample: one per prompt, id `<prompt key>` (a prompt that comes twice in one step gets
   `~<k>` after its key from the second time on), holding the prompt-aligned fields (`prompt_ids`
   without the left padding, the per-token inputs) and its media, one segment per media field; and
   one per response, id `<prompt id>#<g>`, holding the response-aligned fields and the reward.
   So the G responses of a prompt share one copy of its image (G times fewer media bytes than a
   copy per response).
2. Responses end at their end-of-turn token (or at max_new_tokens). Every value owns its memory (no
   view into the batch's tensors): pickled for Ray, a view would carry its whole storage along (the
   driver path shipped the batch's 19 MB of pixels once per prompt before this).
3. `join` gives each response its prompt's values (references, no copies): what a stage that reads
   both kinds of field works on.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from vlmrun.config.families import family_spec
from vlmrun.data.batch import PromptBatch
from vlmrun.data.epochs import is_filler
from vlmrun.generation.prompts import prompt_media
from vlmrun.generation.rollouts import Rollouts
from vlmrun.plane.interface import SampleBatch
from vlmrun.rewards.builtin import Scored


@dataclass
class RolloutRows:
    """A rollout as plane samples (module doc): `prompts` and their prompt-major `responses`."""

    prompts: SampleBatch
    responses: SampleBatch


def prompt_sample_ids(prompt_keys: Sequence[str]) -> list[str]:
    """Unique ids of `prompt_keys` within one step (module doc)."""
    seen: Counter[str] = Counter()
    ids = []
    for key in prompt_keys:
        ids.append(key if not seen[key] else f"{key}~{seen[key]}")
        seen[key] += 1
    return ids


def response_sample_ids(prompt_ids: Sequence[str], group_size: int) -> list[str]:
    return [f"{p}#{g}" for p in prompt_ids for g in range(group_size)]


def prompt_of(response_ids: Sequence[str]) -> list[str]:
    """The prompt id of every response id, each once, in order."""
    return list(dict.fromkeys(r.rpartition("#")[0] for r in response_ids))


def join(prompts: SampleBatch, responses: SampleBatch) -> SampleBatch:
    """Every response with its prompt's columns beside its own (module doc)."""
    where = {pid: i for i, pid in enumerate(prompts.sample_ids)}
    owner = [where[r.rpartition("#")[0]] for r in responses.sample_ids]
    columns = dict(responses.columns)
    for name, values in prompts.columns.items():
        columns[name] = [values[i] for i in owner]
    return SampleBatch(sample_ids=list(responses.sample_ids), columns=columns)


def response_lengths(rollouts: Rollouts) -> list[int]:
    return rollouts.response_mask.sum(dim=1).tolist()


def ended_with(rollouts: Rollouts, eos_ids: Sequence[int]) -> list[bool]:
    """Whether each response ended with one of `eos_ids` (not cut off at max_new_tokens)."""
    lengths = response_lengths(rollouts)
    return [n > 0 and int(rollouts.response_ids[i, n - 1]) in eos_ids for i, n in enumerate(lengths)]


def prompt_columns(batch: PromptBatch, *, family: str, image_token_id: int | None) -> SampleBatch:
    """The prompt samples of a prompt batch (module doc): known before generation starts."""
    return _prompt_columns(batch, list(range(len(batch))), family=family, image_token_id=image_token_id)


def response_columns(rollouts: Rollouts, scored: Sequence[Scored], prompt_ids: Sequence[str]) -> SampleBatch:
    """The response samples of `rollouts` (module doc), rewards from `scored` (row order); `prompt_ids`
    are their prompts' sample ids (`prompt_columns`). A filler prompt's responses (vlmrun.data.epochs)
    have no token that counts in the loss."""
    lengths = response_lengths(rollouts)
    ids = response_sample_ids(prompt_ids, rollouts.group_size)
    columns = {
        "response_ids": [rollouts.response_ids[i, :n].clone() for i, n in enumerate(lengths)],
        "response_mask": [
            torch.full((n,), not is_filler(i), dtype=torch.bool) for i, n in zip(ids, lengths, strict=True)
        ],
        "generation_logprobs": [rollouts.logprobs[i, :n].float().clone() for i, n in enumerate(lengths)],
        "rewards": [torch.tensor(s.reward, dtype=torch.float32) for s in scored],
    }
    return SampleBatch(sample_ids=ids, columns=columns)


def rollout_columns(
    rollouts: Rollouts, scored: Sequence[Scored], *, family: str, image_token_id: int | None
) -> RolloutRows:
    """The generation stage's samples of `rollouts` alone (its prompt rows repeat each prompt G times)."""
    view = PromptBatch(
        sample_ids=rollouts.sample_ids,
        input_ids=rollouts.prompt_ids,
        attention_mask=rollouts.prompt_mask,
        answers=rollouts.answers,
        media=rollouts.media,
        token_inputs=rollouts.token_inputs,
    )
    first = list(range(0, len(rollouts), rollouts.group_size))  # each prompt's first row
    prompts = _prompt_columns(view, first, family=family, image_token_id=image_token_id)
    return RolloutRows(prompts=prompts, responses=response_columns(rollouts, scored, prompts.sample_ids))


def _prompt_columns(batch: PromptBatch, rows: list[int], *, family: str, image_token_id: int | None) -> SampleBatch:
    spec = family_spec(family)
    media = prompt_media(batch, image_token_id)
    unpadded = batch.attention_mask.bool()
    columns: dict[str, list] = {"prompt_ids": [batch.input_ids[i][unpadded[i]] for i in rows]}
    for k in spec.token_keys:
        columns[k] = [batch.token_inputs[k][i][unpadded[i]] for i in rows]
    for k in spec.media_keys:
        columns[k] = [[media[i][k].clone()] if media[i] else [] for i in rows]
    return SampleBatch(sample_ids=prompt_sample_ids([batch.sample_ids[i] for i in rows]), columns=columns)
