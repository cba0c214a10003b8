"""The shims that let megatron-core 0.16.1 train on a machine without CUDA (gloo), in one place.

Applied only where `torch.cuda.is_available()` is false (`apply_cpu_shims`), so a GPU run is untouched:
on a GPU every call below goes to CUDA as megatron-core wrote it. Each shim names the line it works
around (megatron-core 0.16.1, paths under megatron/core/):

1. `torch.cuda.current_device` -> the CPU device. megatron-core places buffers on "the current CUDA
   device" in ~30 places: models/common/embeddings/rotary_pos_embedding.py:297 (mRoPE's inverse
   frequencies), tensor_parallel/mappings.py:91/141/148/181 (the gather and reduce-scatter buffers of
   tensor and sequence parallelism), tensor_parallel/layers.py:552 (the sequence-parallel all-gather),
   pipeline_parallel/p2p_communication.py:190-202/313/321 (the pipeline's shape and receive buffers),
   utils.py:631 (GlobalMemoryBuffer), transformer/moe/router.py:90.
2. `torch.cuda.synchronize` -> nothing: pipeline_parallel/p2p_communication.py:242 synchronizes after
   every exchange of tensor shapes (`variable_seq_lengths`); CPU collectives are done when they return.
3. `torch.zeros(..., device="cuda")` in pipeline_parallel/schedules.py:596/983/2138 (each schedule's
   token counter): that module alone sees a `torch` whose tensor factories put "cuda" tensors on the
   CPU (`_CpuFactories`); no other module's `torch` changes.
4. The CUDA RNG tracker (tensor_parallel/random.py:417-429, `model_parallel_cuda_manual_seed`): a CPU
   tracker with the same named streams (data-parallel, tensor-parallel, expert-parallel seeds) forked
   from CPU generators (`install_cpu_rng_tracker`), so dropout regions and recompute see a tracker.
5. Activation recompute's CUDA RNG state (tensor_parallel/random.py:55/72, `_get_cuda_rng_state` and
   `_set_cuda_rng_state`, called by `CheckpointFunction`): the CPU state, which CheckpointFunction saves
   and restores beside it anyway.
6. transformer/moe/moe_utils.py:34 imports `te_general_gemm` only with Transformer Engine; the router's
   `router_gating_linear` (:1192) reads it regardless: None makes it take torch's matmul.

Beside the CUDA shims, one gap of the local (non-Transformer-Engine) layer specs on any device:
transformer/torch_norm.py:32 asserts that sequence parallelism is off (`WrappedTorchNorm`). With
sequence parallelism a torch norm works as it is when its weights are marked `sequence_parallel`, so
that their gradients (partial sums over each rank's part of the sequence) are summed over the tensor-
parallel group (policy/megatron/grads.py does): `allow_sequence_parallel_norms`, applied by the backend
only when it builds the local spec with `parallel.sequence_parallel`.

The default causal mask (transformer/utils.py `get_default_causal_mask`, built on "cuda") is never
built: the backend passes an explicit mask with every forward (model.py).
"""

from __future__ import annotations

import contextlib

import torch

_APPLIED = {"cpu": False, "sp_norms": False}


def cuda_absent() -> bool:
    return not torch.cuda.is_available()


def apply_cpu_shims() -> bool:
    """Apply the CPU shims (every one but the RNG tracker: `install_cpu_rng_tracker`), once per process, where CUDA is absent; returns
    whether they are applied. Call before megatron-core builds a model (the tracker: `install_cpu_rng_tracker`)."""
    if not cuda_absent():
        return False
    if _APPLIED["cpu"]:
        return True
    from megatron.core.pipeline_parallel import schedules
    from megatron.core.tensor_parallel import random as tp_random
    from megatron.core.transformer.moe import moe_utils

    torch.cuda.current_device = _cpu_device
    torch.cuda.synchronize = _no_sync
    schedules.torch = _CpuFactories(schedules.torch)
    tp_random._get_cuda_rng_state = _cpu_rng_state
    tp_random._set_cuda_rng_state = _keep_rng_state
    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None
    _APPLIED["cpu"] = True
    return True


def _cpu_device() -> torch.device:
    return torch.device("cpu")


def _no_sync(*args, **kwargs) -> None:
    return None


def _cpu_rng_state(*args, **kwargs) -> torch.Tensor:
    return torch.get_rng_state()


def _keep_rng_state(*args, **kwargs) -> None:
    """CheckpointFunction restores the CPU state beside this one: nothing more to set."""


class _CpuFactories:
    """`torch` as pipeline_parallel/schedules.py sees it: every attribute is torch's, except that its
    tensor factories put a tensor asked for on "cuda" on the CPU."""

    _FACTORIES = frozenset({"zeros", "ones", "empty", "tensor", "full"})

    def __init__(self, real):
        self._real = real

    def __getattr__(self, name: str):
        value = getattr(self._real, name)
        if name not in self._FACTORIES:
            return value

        def on_cpu(*args, **kwargs):
            device = kwargs.get("device")
            if device is not None and str(device).startswith("cuda"):
                kwargs["device"] = "cpu"
            return value(*args, **kwargs)

        return on_cpu


def install_cpu_rng_tracker(seed: int, *, tp_rank: int, ep_rank: int = 0, etp_rank: int = 0) -> None:
    """Shim 4: megatron-core's RNG tracker, its streams seeded as `model_parallel_cuda_manual_seed` seeds
    them (data-parallel `seed`, tensor-parallel `seed + 2718 + tp_rank`, expert-parallel
    `seed + 1024 + 100 * ep_rank + etp_rank`), on CPU generators."""
    from megatron.core.tensor_parallel import random as tp_random

    class CpuRngStatesTracker(tp_random.CudaRNGStatesTracker):
        def add(self, name, seed):
            self._is_initialized = True
            self.seeds_.add(seed)
            self.states_[name] = torch.Generator().manual_seed(seed).get_state()

        @contextlib.contextmanager
        def fork(self, name=tp_random._MODEL_PARALLEL_RNG_TRACKER_NAME):
            outer = torch.get_rng_state()
            torch.set_rng_state(self.states_[name])
            try:
                yield
            finally:
                self.states_[name] = torch.get_rng_state()
                torch.set_rng_state(outer)

    tracker = CpuRngStatesTracker()
    tracker.add(tp_random._DATA_PARALLEL_RNG_TRACKER_NAME, seed)
    tracker.add(tp_random._MODEL_PARALLEL_RNG_TRACKER_NAME, seed + 2718 + tp_rank)
    tracker.add(tp_random._EXPERT_PARALLEL_RNG_TRACKER_NAME, seed + 1024 + 100 * ep_rank + etp_rank)
    tp_random._CUDA_RNG_STATE_TRACKER = tracker
    tp_random._CUDA_RNG_STATE_TRACKER_INITIALIZED = True


def allow_sequence_parallel_norms() -> None:
    """Let the local spec's torch norms run under sequence parallelism, once per process:
    built with sequence parallelism off, their weights marked `sequence_parallel`."""
    if _APPLIED["sp_norms"]:
        return
    from megatron.core.transformer import torch_norm

    built = torch_norm.WrappedTorchNorm.__new__

    def new(cls, config, hidden_size, eps=1e-5, **kwargs):
        sequence_parallel = config.sequence_parallel
        config.sequence_parallel = False
        try:
            norm = built(cls, config, hidden_size, eps, **kwargs)
        finally:
            config.sequence_parallel = sequence_parallel
        for p in norm.parameters():
            p.sequence_parallel = sequence_parallel
        return norm

    torch_norm.WrappedTorchNorm.__new__ = new
    _APPLIED["sp_norms"] = True
