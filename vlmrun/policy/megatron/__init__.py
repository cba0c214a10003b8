"""The `megatron` policy backend (`model.backend: megatron`; backend.py): megatron-core's GPTModel with
the HF vision tower in front, tensor and pipeline parallel, on gloo/CPU (cpu_shims.py) or NCCL/GPU.
megatron-core is imported only inside this package's modules, when a policy is opened: never on the
submit path.

- The model (model.py, stage.py): megatron-core 0.16.1's `GPTModel` (mRoPE, local layer specs;
  Transformer Engine's where installed on a GPU) with transformers' own vision tower in front on the
  first pipeline stage, for Qwen2-VL and Qwen2.5-VL. Each rank builds its stage from the HF config.
- The weights (mapping.py, weights.py): our HF <-> megatron mapping, both ways (fused QKV group-major,
  gate+up fc1, row/column/vocabulary splits, pipeline layer offsets, a tied head as a copy). The same
  mapping loads HF weights, writes checkpoints as pieces of HF tensors (state.py, `Storage.PIECES`:
  any tp x pp reads them, so a resume may change the layout), refits engines with whole HF tensors
  (refit.py: gathered over tp, sent over pp to the replica's owner, one bucket at a time) and exports a
  transformers directory.
- A step (schedule.py, grads.py): the replica's micro-batches through megatron's schedules (1F1B under
  pp) with our loss on the last stage, normalised by the global token count as in the hf backend; then
  our gradient sync over dp and a tp/pp-aware gradient norm (replicated parameters counted once);
  torch AdamW.
- Groups (groups.py): megatron's parallel state in the layout's own order (config/layout.py).
- Where CUDA is absent, cpu_shims.py applies the shims megatron-core needs on gloo, each naming the line
  it works around; none is applied on a GPU.

What the backend can run is declared in config/backends.py and asked by the recipe check; a layout the
model cannot be cut into is refused at submit (models/layout_check.py); the fit check estimates the
peaking pipeline stage (models/memory_layout.py).
"""
