"""Generation for GRPO: sample G responses per prompt with log-probs, take new weights from the policy.

`interface.py` is the seam (`GenerationBackend`, `SamplingParams`); `rollouts.py` the record it returns;
`prompts.py` selects prompts of a `PromptBatch` with their media; `hf.py` the transformers backend (one
replica in this process) and `group.py` replicas in Ray actors. `measure.py` prints throughput as JSON.
"""
