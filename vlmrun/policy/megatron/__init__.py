"""The `megatron` policy backend (backend.py): megatron-core's GPTModel with the HF vision tower in
front, tensor and pipeline parallel, on gloo/CPU (cpu_shims.py) or NCCL/GPU. megatron-core is imported
only inside this package's modules, when a policy is opened: never on the submit path."""
