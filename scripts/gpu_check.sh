#!/usr/bin/env bash
# The demo through vLLM's CUDA build, when a CUDA device is present, and its figures: rollout
# tokens/s, weight-sync seconds (pushes go through a folder and /collective_rpc reload_weights;
# NCCL / IPC transfer is not built) and the engine-trainer logprob mismatch.
# Prepared, NOT yet run: the machine tiller is developed on has no CUDA device. Without one it
# says so and exits 0. TILLER_VLLM_GPU_PYTHON: a Python with vLLM's CUDA build (default
# .venv-vllm-gpu, built here with `pip install vllm` if missing).
set -euo pipefail
cd "$(dirname "$0")/.."
if ! command -v nvidia-smi >/dev/null 2>&1 || ! nvidia-smi -L >/dev/null 2>&1; then
  echo "gpu_check: no CUDA device (nvidia-smi -L failed); skipped"
  exit 0
fi
PY="${TILLER_VLLM_GPU_PYTHON:-.venv-vllm-gpu/bin/python}"
if ! "$PY" -c "import vllm" >/dev/null 2>&1; then
  python3 -m venv .venv-vllm-gpu
  PY=.venv-vllm-gpu/bin/python
  "$PY" -m pip install -q --disable-pip-version-check vllm
fi
OUT="${1:-runs/gpu-check}"
.venv/bin/python -m tiller train configs/calculator.yaml --output-dir "$OUT" \
  engine.backend=vllm "engine.python=$PY" model.device=cuda \
  model.build.num_heads=4 engine.kv_cache_bytes=1073741824
.venv/bin/python - "$OUT" <<'PY'
import json, sys
rows = [json.loads(l) for l in open(f"{sys.argv[1]}/metrics.jsonl")]
rl = [r for r in rows if r["phase"] == "rl"]
tokens, seconds = sum(r["rollout_tokens"] for r in rl), sum(r["rollout_s"] for r in rl)
print(f"rollout tokens/s {tokens / seconds:.0f}; sync s median "
      f"{sorted(r['sync/time_s'] for r in rl)[len(rl) // 2]:.3f}; "
      f"logp mismatch max {max(r['logp_mismatch_max'] for r in rl):.2e}")
PY
