"""bf16 against fp32 log-probabilities of the same tokens: NeMo RL's `token_mult_prob_error`.

token_mult_prob_error = mean over the valid target tokens of exp(|logp_bf16 - logp_fp32|), the factor by
which two forwards disagree on a token's probability (1.0: identical). The fp32 forward runs with TF32
off (a true fp32 reference); the bf16 forward runs on the same parameters cast to bf16, as an inference
engine holding bf16 weights would (buffers such as the rotary `inv_freq` stay fp32, as under FSDP's
MixedPrecisionPolicy: `model.to(bfloat16)` would round those too and inflate the error). Valid targets are every next token except the image placeholders.
The model is random-init: its near-uniform logits understate the error of a trained model, so read the
number as a check that the bf16 path is wired right (finite, close to 1), not as the trained value.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator

import torch
import workload


def token_logprobs(logits: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
    """log p(token t+1 | tokens <= t) in fp32, shape (batch, seq - 1)."""
    logp = torch.log_softmax(logits[:, :-1].float(), dim=-1)
    return logp.gather(-1, input_ids[:, 1:, None]).squeeze(-1)


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


@torch.no_grad()
def logprob_error(scale: workload.Scale) -> dict:
    """token_mult_prob_error of the training-sized model on one synthetic sequence."""
    config = workload.build_config(scale.train_overrides)
    batch = workload.synthetic_batch(
        config, seq_len=scale.seq_len, image_side=scale.image_side, device=scale.device, seed=4
    )
    labels = batch.pop("labels")
    model = workload.build_model(config, device=scale.device, seed=0).eval()
    with no_tf32():
        fp32 = token_logprobs(model(**batch, use_cache=False).logits, batch["input_ids"])
    for p in model.parameters():
        p.data = p.data.to(torch.bfloat16)
    bf16 = token_logprobs(model(**batch, use_cache=False).logits, batch["input_ids"])
    del model
    valid = labels[:, 1:] != -100
    delta = (bf16 - fp32).abs()[valid]
    error = torch.exp(delta)
    report = {
        "valid_tokens": int(valid.sum()),
        "token_mult_prob_error": float(error.mean()),
        "token_mult_prob_error_median": float(error.median()),
        "token_mult_prob_error_max": float(error.max()),
        "mean_abs_logprob_diff": float(delta.mean()),
        "fp32_mean_logprob": float(fp32[valid].mean()),
        "definition": "mean over valid tokens of exp(|logp_bf16 - logp_fp32|); bf16 = parameters cast to bf16",
        "note": "random-init weights: near-uniform logits understate a trained model's error",
    }
    values = [report[k] for k in report if k.startswith("token_mult")]
    if not all(math.isfinite(v) and v >= 1.0 for v in values):
        report |= {"ok": False, "error": f"token_mult_prob_error must be finite and >= 1, got {values}"}
    return report
