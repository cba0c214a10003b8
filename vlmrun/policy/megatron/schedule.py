"""Micro-batches through the pipeline: megatron-core's schedules (no pipelining at pp = 1, 1F1B above),
our loss on the last stage.

Every rank of a data-parallel replica runs the same micro-batches (the worker feeds them all: one
loader per replica). The schedule calls `forward_step` per micro-batch; on the last stage its loss
function turns the stage's logits into the labelled tokens' log-probs (model.py) and hands them to
`on_logprobs(k, logprobs)`, which returns the micro-batch's loss tensor, already divided by the step's
global token count (the schedule backpropagates it as it is: `calculate_per_token_loss`), or None in a
forward-only pass. The pipeline sends each micro-batch's shape before its tensor
(`variable_seq_lengths`), so micro-batches may differ in length and rows.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from vlmrun.policy.megatron.model import StageInputs, VisionLanguageStage, labelled_logprobs


def run_micro_batches(
    stage: VisionLanguageStage,
    inputs: list[StageInputs],
    widths: list[int],
    on_logprobs: Callable[[int, torch.Tensor], torch.Tensor | None],
    *,
    forward_only: bool,
) -> None:
    """Forward (and backward, unless `forward_only`) of every micro-batch in order, the loss on the last stage;
    `widths[k]` is micro-batch k's token count before any sequence-parallel padding."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    order = iter(range(len(inputs)))

    def forward_step(data_iterator, model):
        k = next(data_iterator)
        output = model(inputs[k])

        def loss_func(logits):
            logprobs = labelled_logprobs(logits, inputs[k], widths[k])
            loss = on_logprobs(k, logprobs)
            if loss is None:
                loss = logprobs.new_zeros(())
            return loss, torch.tensor(0, dtype=torch.int), {}

        return output, loss_func

    longest = max(i.input_ids.shape[1] for i in inputs)
    rows = max(i.input_ids.shape[0] for i in inputs)
    get_forward_backward_func()(
        forward_step_func=forward_step,
        data_iterator=order,
        model=[stage],
        num_microbatches=len(inputs),
        seq_length=longest,
        micro_batch_size=rows,
        forward_only=forward_only,
    )
