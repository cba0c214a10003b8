"""Validation scoring: NLL on the assistant tokens and exact-match accuracy of greedy answers."""

from __future__ import annotations

import torch

from vlmrun.policy.loss import nll_sum, valid_tokens


@torch.no_grad()
def score_batches(
    model, tokenizer, loss_batches: list, prompt_batches: list, *, max_new_tokens: int = 4
) -> list[float]:
    """Returns [nll_sum, tokens, correct, answered] summed over the given batches (this rank only)."""
    was_training = model.training
    model.eval()
    nll = tokens = correct = answered = 0.0
    try:
        for b in loss_batches:
            out = model(**b.model_inputs(), use_cache=False)
            nll += float(nll_sum(out.logits, b.labels))
            tokens += valid_tokens(b.labels)
        for p in prompt_batches:
            generated = model.generate(
                **p.model_inputs(),
                max_new_tokens=max_new_tokens,
                do_sample=False,
                pad_token_id=tokenizer.pad_token_id,
                eos_token_id=tokenizer.eos_token_id,
            )
            new = generated[:, p.input_ids.shape[1] :]
            for text, answer in zip(tokenizer.batch_decode(new, skip_special_tokens=True), p.answers, strict=True):
                correct += float(text.strip() == answer.strip())
                answered += 1
    finally:
        model.train(was_training)
    return [nll, tokens, correct, answered]
