#!/usr/bin/env bash
# Every GPU check in one go, each under its own time limit; their JSON lands in $OUT.
#   bash tools/gpu/run_checks.sh                      # from the repository root, on the GPU machine
#   OUT=/tmp/out CHECK_S=300 MULTI_S=240 bash tools/gpu/run_checks.sh
# 1. tools/gpu/check.py: CUDA, NCCL, the matmul ceiling, the policy's step of the 3B layout (tokens/s,
#    MFU), a DCP resume, bf16 log-prob error, the fit estimate against the measured peak.
# 2. tools/gpu/policy_check.py: the policy from the tiny model's directory, validation included.
# 3. tools/gpu/multi_gpu_check.py, where torch sees 2 or more GPUs: FSDP2, HSDP and offload over NCCL.
# Needs torch, numpy and transformers only (no Ray, no network). A check that runs out of time is
# killed (exit 124 in summary.json); the next one still runs.
set -u
cd "$(dirname "$0")/../.."
OUT=${OUT:-$PWD/gpu-checks}
PY=${PYTHON:-python3}
mkdir -p "$OUT"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} HF_HUB_OFFLINE=1
declare -A rc
timeout "${CHECK_S:-360}" "$PY" tools/gpu/check.py --out "$OUT/gpu_check.json" >"$OUT/gpu_check.log" 2>&1
rc[check]=$?
tiny=$("$PY" -c "from vlmrun.models.tiny import ensure_tiny_model; print(ensure_tiny_model('qwen2_5_vl', '$OUT/tiny'))" 2>>"$OUT/policy_check.log")
timeout "${POLICY_S:-120}" "$PY" tools/gpu/policy_check.py --model-dir "$tiny" --out "$OUT/policy_check.json" >>"$OUT/policy_check.log" 2>&1
rc[policy]=$?
gpus=$("$PY" -c "import torch; print(torch.cuda.device_count())" 2>/dev/null || echo 0)
if [ "${gpus:-0}" -ge 2 ]; then
  timeout "${MULTI_S:-540}" "$PY" tools/gpu/multi_gpu_check.py --time-limit "${CASE_S:-240}" \
    --out "$OUT/multi_gpu_check.json" >"$OUT/multi_gpu_check.log" 2>&1
  rc[multi]=$?
else
  rc[multi]="skipped: $gpus GPU(s), the multi-GPU check needs 2 or more"
fi
"$PY" - "$OUT" "${rc[check]}" "${rc[policy]}" "${rc[multi]}" <<'PY'
import json, sys
out, check, policy, multi = sys.argv[1:]
summary = {"check": check, "policy_check": policy, "multi_gpu_check": multi, "out": out}
open(f"{out}/summary.json", "w").write(json.dumps(summary, indent=2) + "\n")
print(json.dumps(summary))
PY
