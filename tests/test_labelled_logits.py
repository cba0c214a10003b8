"""The policy projects onto the vocabulary only the positions whose next token carries a label
(policy/loss.py), and gets the log-probs and gradients the whole sequence's logits give, to fp32
round-off, for every family: on CLEVR rows (an image each, a short answer), a text-only row, and
GRPO-shaped labels (a response after an unlabelled prompt)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from data_samples import FAMILIES, free_port, make_recipe, rank_policy

from vlmrun.data.batch import IGNORE_INDEX, Batch
from vlmrun.policy.loss import NllLoss, labelled_logprobs, nll_sum, scored_positions, token_logprobs


def test_labelled_logprobs_are_the_definitions_values_at_the_labelled_positions():
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 7, 11, generator=gen)
    labels = torch.randint(0, 11, (3, 7), generator=gen)
    labels[0, :4] = IGNORE_INDEX
    labels[1] = IGNORE_INDEX  # a row with nothing to score
    labels[2, 3] = IGNORE_INDEX  # a gap inside the labelled span
    keep = scored_positions(labels)
    assert keep[:, -1].sum() == 0 and int(keep.sum()) == int((labels[:, 1:] != IGNORE_INDEX).sum())
    got = labelled_logprobs(logits[keep], labels)
    assert torch.allclose(got, token_logprobs(logits, labels), rtol=0, atol=1e-6)
    assert float(got[1].abs().sum()) == 0.0 and float(got[0, :3].abs().sum()) == 0.0
    assert torch.allclose(-got.sum(), nll_sum(logits, labels))
    with pytest.raises(ValueError, match="5 rows of logits for 8 labelled tokens"):
        labelled_logprobs(logits[keep][:5], labels)


@pytest.fixture(scope="module")
def batches(clevr_set, tiny_dirs):
    """family -> (recipe, [two CLEVR rows, a text-only row, GRPO-shaped rows])."""
    from transformers import AutoTokenizer

    from vlmrun.data.loader import val_batches

    out = {}
    for family in FAMILIES:
        recipe = make_recipe(clevr_set, family=family)
        (clevr, *_), _, _ = val_batches(recipe, processor_dir=tiny_dirs[family], samples=2, batch_size=2)
        ids = torch.tensor([AutoTokenizer.from_pretrained(tiny_dirs[family]).encode("how many cubes? answer: 3 cubes")])
        text = Batch(["text"], ids, torch.ones_like(ids), ids.clone())
        response = clevr.labels.clone()  # a "response": the last 12 positions, the prompt unlabelled
        response[:, :-12] = IGNORE_INDEX
        grpo = dataclasses.replace(clevr, labels=response)
        out[family] = recipe, [clevr, text, grpo]
    return out


@pytest.mark.slow  # a tiny policy per family (~80 s in all)
@pytest.mark.parametrize("family", FAMILIES)
def test_the_policys_logprobs_and_gradients_are_the_whole_logits(batches, tiny_dirs, family):
    recipe, micro_batches = batches[family]
    policy, _ = rank_policy(recipe, 0, 1, tiny_dirs[family], {}, free_port())
    model = policy.model
    try:
        for b in micro_batches:
            whole = model(**b.model_inputs(), use_cache=False).logits
            assert whole.shape[1] == b.labels.shape[1]
            want = token_logprobs(whole, b.labels)
            got = policy.logprobs(b)
            assert torch.allclose(got, want, rtol=0, atol=1e-5), float((got - want).abs().max())
            assert float(got[b.labels[:, 1:] == IGNORE_INDEX].abs().sum()) == 0.0

            model.zero_grad(set_to_none=True)
            nll_sum(model(**b.model_inputs(), use_cache=False).logits, b.labels).backward()
            want_grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
            model.zero_grad(set_to_none=True)
            NllLoss()(policy._logprobs(model, b), b).total.backward()
            got_grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
            assert got_grads.keys() == want_grads.keys()
            for name, g in want_grads.items():
                assert torch.allclose(got_grads[name], g, rtol=1e-4, atol=1e-6), name
        model.zero_grad(set_to_none=True)
    finally:
        policy.shutdown()
