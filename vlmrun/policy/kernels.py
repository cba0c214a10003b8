"""The compiled kernels a model's fast path needs on a GPU, checked where the rank builds the model.

transformers' NemotronH (Nemotron-Omni's language model) runs its Mamba layers through `mamba_ssm` and
`causal_conv1d` when they import, and silently through its reference PyTorch path when they do not
(integrations/hub_kernels.py: any import error, an extension built for another torch included, means
the fallback). That path is slow, holds more memory in its prefill than the fit check counts, and
cannot keep packed sequences apart. A CUDA rank of such a model refuses to start without the kernels,
naming the extra that brings them; `vlmrun submit` checks the same where the run executes
(cluster/preflight.py), before anything starts. CPU ranks run the reference path, as every CPU test does.
"""

from __future__ import annotations

import importlib

import torch

#: Module class name prefix -> the packages its fast path imports (transformers' names for them).
NEEDS = {"NemotronHMamba": ("mamba_ssm", "causal_conv1d")}
EXTRA = "vlmrun[gpu]"


def kernels_needed(model: torch.nn.Module) -> tuple[str, ...]:
    """The kernel packages `model`'s modules take their fast path from (none for most models)."""
    names = {type(m).__name__ for m in model.modules()}
    return tuple(
        sorted(
            {
                package
                for prefix, packages in NEEDS.items()
                if any(n.startswith(prefix) for n in names)
                for package in packages
            }
        )
    )


def check_cuda_kernels(model: torch.nn.Module, device: torch.device) -> None:
    """On a CUDA device, raise RuntimeError naming each kernel package `model` needs that does not import
    here, and why; on a CPU, nothing (module doc)."""
    if device.type != "cuda":
        return
    missing = []
    for package in kernels_needed(model):
        try:
            importlib.import_module(package)
        except Exception as e:  # noqa: BLE001 - an ImportError, or an extension's undefined symbol
            missing.append(f"{package} ({type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''})")
    if missing:
        raise RuntimeError(
            f"{type(model).__name__} on a GPU needs {', '.join(missing)}: without them transformers runs its "
            f"slow reference path; install the `gpu` extra on the nodes (pip install --no-build-isolation "
            f"'{EXTRA}', built against this torch {torch.__version__}) or use the container (container/README.md)"
        )
