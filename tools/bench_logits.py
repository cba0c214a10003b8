"""The loss's memory with logits for the labelled positions only (the policy's path) against the logits
of every position (before), side by side in interleaved rounds, as JSON.

    .venv/bin/python tools/bench_logits.py [--recipe recipes/tiny-clevr-cpu.yaml] [--family F] [--rounds 5]
                                           [--answer-tokens 3] [--set data.max_seq_len=1024 ...] [--json]

For the family's tiny model on one rank (the recipe's policy, opened as a run's rank opens it), one
micro-batch of the recipe's shape (`train.micro_batch_size` one-image conversations padded with text
to `data.max_seq_len` tokens, tools/measure_memory.py) whose labels are those of a CLEVR row: only the
last `--answer-tokens` tokens of each (the answer and its end token; a GRPO recipe: its
`grpo.max_new_tokens` response tokens).

Two measurements per way, each the CPU allocator's peak under torch.profiler (bytes allocated and
not yet freed, tools/measure_memory.py's `profiled_peak`), one way after the other in each round:

- `loss`: what runs after the model's trunk, from its final hidden states (captured at the LM head's
  input, detached, allocated before): the LM head, the fp32 log-softmax and the backward to the hidden
  states (their gradient, [B, T, H] either way, counts). Whole: every position, then
  the NLL of the labelled ones (`policy.loss.nll_sum`, the code before). Labelled: the positions of
  `scored_positions` alone, then `labelled_logprobs` and `NllLoss` (transformers' `logits_to_keep`
  slices the hidden states the same way before its LM head).
- `step`: the forward and backward of the whole model, the product's own `HfPolicy._logprobs` against
  the model's whole logits into `nll_sum`.

Ratios are labelled / whole per round, with their spread; `logits_elements` are the sizes of the logits
either way.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch
from measure_memory import RECIPE, padded_batch, profiled_peak, rank_policy

from vlmrun.data.batch import IGNORE_INDEX
from vlmrun.observe.ratios import ratio_spread, round_ratios
from vlmrun.policy.loss import NllLoss, labelled_logprobs, nll_sum, scored_positions


def measure(recipe, family: str, rounds: int, answer_tokens: int, cache: Path) -> dict:
    from transformers import AutoProcessor

    from vlmrun.config.dtype import torch_dtype
    from vlmrun.models.fit import training_shape
    from vlmrun.models.source import ensure_model

    recipe = recipe.model_copy(update={"model": recipe.model.model_copy(update={"family": family})})
    shape, _ = training_shape(recipe)
    model_dir = str(ensure_model(recipe.model, cache, seed=0))
    policy = rank_policy(recipe, model_dir, max_steps=1)
    try:
        processor = AutoProcessor.from_pretrained(model_dir)
        batch = padded_batch(
            processor,
            recipe.train.micro_batch_size,
            recipe.data.max_seq_len,
            shape.image_size,
            torch_dtype(recipe.model.dtype),
        )
        batch.labels[:, :-answer_tokens] = IGNORE_INDEX
        model = policy.model
        head = model.get_output_embeddings() or _lm_head(model)  # Nemotron-Omni's is its language model's
        hidden = _final_hidden(model, head, batch)
        keep = scored_positions(batch.labels)

        h = hidden.clone().requires_grad_()  # the trunk's output, alive in a step either way

        def loss_whole():
            nll_sum(head(h), batch.labels).backward()
            h.grad = None

        def loss_labelled():
            NllLoss()(labelled_logprobs(head(h[keep]), batch.labels), batch).total.backward()
            h.grad = None

        def step_whole():
            nll_sum(model(**batch.model_inputs(), use_cache=False).logits, batch.labels).backward()
            model.zero_grad(set_to_none=True)

        def step_labelled():
            NllLoss()(policy._logprobs(model, batch), batch).total.backward()
            model.zero_grad(set_to_none=True)

        for fn in (step_whole, step_labelled):  # warm-up: first-call allocations
            fn()
        peaks = {k: [] for k in ("loss_whole", "loss_labelled", "step_whole", "step_labelled")}
        for _ in range(rounds):
            for name, fn in (
                ("loss_whole", loss_whole),
                ("loss_labelled", loss_labelled),
                ("step_whole", step_whole),
                ("step_labelled", step_labelled),
            ):
                peaks[name].append(profiled_peak(fn))
    finally:
        policy.shutdown()
    vocab = head.weight.shape[0]
    return {
        "family": family,
        "sequences": int(batch.input_ids.shape[0]),
        "seq_len": int(batch.input_ids.shape[1]),
        "labelled_tokens": int(keep.sum()),
        "vocab": int(vocab),
        "logits_elements": {"whole": int(batch.input_ids.numel() * vocab), "labelled": int(keep.sum() * vocab)},
        "loss_peak_bytes": {k: int(statistics.median(peaks[f"loss_{k}"])) for k in ("whole", "labelled")},
        "step_peak_bytes": {k: int(statistics.median(peaks[f"step_{k}"])) for k in ("whole", "labelled")},
        "loss_labelled_over_whole": ratio_spread(round_ratios(peaks["loss_labelled"], peaks["loss_whole"])),
        "step_labelled_over_whole": ratio_spread(round_ratios(peaks["step_labelled"], peaks["step_whole"])),
    }


def _final_hidden(model, head, batch) -> torch.Tensor:
    """The hidden states the LM head reads in a forward of `batch` ([B, T, H], detached)."""
    seen = []
    hook = head.register_forward_hook(lambda _m, inputs, _out: seen.append(inputs[0].detach()))
    try:
        with torch.no_grad():
            model(**batch.model_inputs(), use_cache=False)
    finally:
        hook.remove()
    return seen[0]


def _lm_head(model) -> torch.nn.Module:
    return next(m for name, m in model.named_modules() if name.split(".")[-1] == "lm_head")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--recipe", type=Path, default=RECIPE)
    parser.add_argument("--family", default="qwen2_5_vl", help="a family of vlmrun/config/families.py")
    parser.add_argument("--rounds", type=int, default=5, help="interleaved rounds (default 5)")
    parser.add_argument(
        "--answer-tokens", type=int, default=None, help="labelled tokens per row (default 3; GRPO: grpo.max_new_tokens)"
    )
    parser.add_argument("--set", action="append", default=[], help="recipe override, e.g. data.max_seq_len=1024")
    parser.add_argument("--json", action="store_true", help="one JSON object (the default output too)")
    args = parser.parse_args()
    from vlmrun.config.load import load_recipe

    recipe = load_recipe(args.recipe, args.set)
    if args.rounds < 1:
        sys.exit(f"--rounds {args.rounds}: at least 1")
    answer = args.answer_tokens or (recipe.grpo.max_new_tokens if recipe.train.algorithm == "grpo" else 3)
    torch.manual_seed(0)
    with tempfile.TemporaryDirectory(prefix="vlmrun-bench-logits-") as tmp:
        print(json.dumps(measure(recipe, args.family, args.rounds, answer, Path(tmp))))


if __name__ == "__main__":
    main()
