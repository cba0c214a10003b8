"""bf16 against fp32 log-probabilities of the same tokens, from vlmrun's policy: NeMo RL's `token_mult_prob_error`.

token_mult_prob_error = mean over the valid target tokens of exp(|logp_bf16 - logp_fp32|), the factor by
which two forwards disagree on a token's probability (1.0: identical). Both come from the policy's own
`logprobs` (the scores GRPO's logprob stage and validation take) of two policies built from the same
config and seed (workload.open_check_policy, FSDP2 on one rank, the same fp32 weights): one computing
in fp32 with TF32 off (a true fp32 reference), one under the recipes' bf16 mixed precision (FSDP2 casts
parameters to bf16 for compute; buffers such as the rotary `inv_freq` stay fp32). Valid targets are the
positions the policy scores (labels not IGNORE_INDEX: every next token except the image placeholders).
The model is random-init: its near-uniform logits understate the error of a trained model, so read the
number as a check that the bf16 path is wired right (finite, close to 1), not as the trained value.
"""

from __future__ import annotations

import contextlib
import gc
import math
from collections.abc import Iterator

import torch
import workload

from vlmrun.data.batch import IGNORE_INDEX


@contextlib.contextmanager
def no_tf32() -> Iterator[None]:
    """IEEE fp32 (no TF32) for matmuls and cuDNN convolutions for the duration. Uses the fp32_precision
    API only: torch raises when a legacy `allow_tf32` read meets flags set through the new one."""
    knobs = (torch.backends.cuda.matmul, torch.backends.cudnn.conv)
    before = [knob.fp32_precision for knob in knobs]
    for knob in knobs:
        knob.fp32_precision = "ieee"
    try:
        yield
    finally:
        for knob, value in zip(knobs, before, strict=True):
            knob.fp32_precision = value


def policy_logprobs(config: dict, scale: workload.Scale, batch, *, mixed_precision: str) -> torch.Tensor:
    """The policy's `logprobs` of `batch` under `mixed_precision`, [1, T-1] float32 on the CPU."""
    policy = workload.open_check_policy(config, scale, seed=0, mixed_precision=mixed_precision)
    try:
        return policy.logprobs(batch)
    finally:
        policy.shutdown()
        del policy
        gc.collect()
        if scale.device == "cuda":
            torch.cuda.empty_cache()


def logprob_error(scale: workload.Scale) -> dict:
    """token_mult_prob_error of the training-sized model on one synthetic sequence."""
    config = workload.model_config(scale.train_overrides)
    batch = workload.synthetic_batch(config, seq_len=scale.seq_len, image_side=scale.image_side, seed=4)
    with no_tf32():
        fp32 = policy_logprobs(config, scale, batch, mixed_precision="none")
    bf16 = policy_logprobs(config, scale, batch, mixed_precision="bf16")
    valid = batch.labels[:, 1:] != IGNORE_INDEX
    delta = (bf16 - fp32).abs()[valid]
    error = torch.exp(delta)
    report = {
        "valid_tokens": int(valid.sum()),
        "token_mult_prob_error": float(error.mean()),
        "token_mult_prob_error_median": float(error.median()),
        "token_mult_prob_error_max": float(error.max()),
        "mean_abs_logprob_diff": float(delta.mean()),
        "fp32_mean_logprob": float(fp32[valid].mean()),
        "definition": "mean over valid tokens of exp(|logp_bf16 - logp_fp32|); both the policy's logprobs, "
        "bf16 = parallel.mixed_precision bf16 over the same fp32 weights",
        "note": "random-init weights: near-uniform logits understate a trained model's error",
    }
    values = [report[k] for k in report if k.startswith("token_mult")]
    if not all(math.isfinite(v) and v >= 1.0 for v in values):
        report |= {"ok": False, "error": f"token_mult_prob_error must be finite and >= 1, got {values}"}
    return report
