"""`vlmrun export` of an hf policy's checkpoint: a Hugging Face model directory (config, generation config
and safetensors weights in the spec's dtype, and the processor, tokenizer and chat template of the spec's
directory).

A LoRA run's checkpoint holds the adapters only (policy/lora.py); the base is the run's model directory
(its fingerprint is in the run identity). Its export is the base merged with the trained adapters,
through the same merge as a refit (`merged_tensors`), so an engine and a reader of the export hold the
same weights; or, with `adapter`, the adapters as peft writes them.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from pathlib import Path

from vlmrun.checkpoint.parts import MODEL_PART, PolicyState, Storage
from vlmrun.models.build import build_model, quiet_transformers, save_model_directory
from vlmrun.models.spec import ModelSpec
from vlmrun.policy.lora import adapter_state, add_adapters, load_adapters, merged_tensors, peft_config


def trained_model(spec: ModelSpec, read: Callable[[PolicyState], PolicyState]):
    """The base of `spec` with its adapters as the checkpoint `read` holds them (one process, on the CPU)."""
    model = add_adapters(build_model(spec), spec.lora)
    state = read(PolicyState(Storage.REPLICATED, {MODEL_PART: adapter_state(model.state_dict())}))
    load_adapters(model, state.parts[MODEL_PART])
    return model


def export(spec: ModelSpec, read: Callable[[PolicyState], PolicyState], out: Path, *, adapter: bool = False) -> None:
    """Write the model directory of the checkpoint `read` fills to `out` (module doc); with `adapter` (a
    LoRA run), the peft adapter directory that peft loads onto the base."""
    with quiet_transformers():
        if spec.lora is not None and adapter:
            _save_adapter(spec, trained_model(spec, read), out)
        elif spec.lora is not None:
            save_model_directory(_merged_model(spec, read), spec, out)
        else:
            model = build_model(spec)
            state = read(PolicyState(Storage.REPLICATED, {MODEL_PART: model.state_dict()}))
            model.load_state_dict(state.parts[MODEL_PART], strict=True)
            save_model_directory(model, spec, out)


def _merged_model(spec: ModelSpec, read: Callable[[PolicyState], PolicyState]):
    """The base of `spec` holding the trained adapters merged into its weights (the refit's merge)."""
    merged = dict(merged_tensors(trained_model(spec, read), lambda t: t))
    base = build_model(spec)
    missing, unexpected = base.load_state_dict(merged, strict=False)
    tied = {n for n in missing if base.get_parameter(n) is not None and _is_tied(base, n)}
    if unexpected or set(missing) - tied:
        raise RuntimeError(f"merged weights: missing {sorted(set(missing) - tied)}, unexpected {sorted(unexpected)}")
    return base


def _is_tied(model, name: str) -> bool:
    """Whether parameter `name` is the same tensor as another, earlier-named one (a tied head)."""
    p = model.get_parameter(name)
    return any(q is p and n != name for n, q in model.named_parameters(remove_duplicate=False))


def _save_adapter(spec: ModelSpec, model, out: Path) -> None:
    """The adapters as `PeftModel.save_pretrained` writes them, for `PeftModel.from_pretrained(base, out)`."""
    from peft import get_peft_model

    base = build_model(spec)
    with warnings.catch_warnings():  # peft asks transformers a name it deprecated; the export's stderr stays clean
        warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing", category=FutureWarning)
        peft_model = get_peft_model(base, peft_config(base, spec.lora))
    wrapped = {f"base_model.model.{k}": v for k, v in adapter_state(model.state_dict()).items()}
    missing, unexpected = peft_model.load_state_dict(wrapped, strict=False)
    if unexpected or adapter_state(dict.fromkeys(missing)):
        raise RuntimeError(f"adapter export: unexpected {sorted(unexpected)}")
    peft_model.save_pretrained(out)
