#!/usr/bin/env bash
# The demo through vLLM's CUDA build, when a CUDA device is present, and its figures: rollout
# tokens/s, weight-sync seconds (pushes go through a folder and /collective_rpc reload_weights;
# NCCL / IPC transfer is not built) and the engine-trainer logprob mismatch.
# Prepared, NOT yet run: the machine tiller is developed on has no CUDA device. Without one it
# says so and exits 0. It installs nothing (a GPU machine may have no network); it needs two
# Pythons, each checked before anything runs, and stops with what is missing:
#   TILLER_TRAIN_PYTHON     the trainer's: tiller installed, a CUDA build of torch
#                           (default .venv/bin/python, whose torch is CPU-only as setup.sh
#                           builds it: pip install torch==2.13.0 from the CUDA index there)
#   TILLER_VLLM_GPU_PYTHON  the servers': vLLM's CUDA build (default .venv-vllm-gpu/bin/python;
#                           e.g. python3 -m venv .venv-vllm-gpu && .venv-vllm-gpu/bin/pip
#                           install vllm==0.32.0, on a machine with network)
set -euo pipefail
cd "$(dirname "$0")/.."
if ! command -v nvidia-smi >/dev/null 2>&1 || ! nvidia-smi -L >/dev/null 2>&1; then
  echo "gpu_check: no CUDA device (nvidia-smi -L failed); skipped"
  exit 0
fi
TRAIN="${TILLER_TRAIN_PYTHON:-.venv/bin/python}"
VLLM="${TILLER_VLLM_GPU_PYTHON:-.venv-vllm-gpu/bin/python}"
if ! "$TRAIN" -c "import tiller, torch; assert torch.cuda.is_available()" >/dev/null 2>&1; then
  echo "gpu_check: $TRAIN cannot import tiller with a CUDA torch (torch.cuda.is_available()" \
       "is false or the import fails); set TILLER_TRAIN_PYTHON to one that can" >&2
  exit 1
fi
if ! "$VLLM" -c "import torch, vllm; assert torch.cuda.is_available()" >/dev/null 2>&1; then
  echo "gpu_check: $VLLM cannot import vllm with a CUDA torch; set TILLER_VLLM_GPU_PYTHON to" \
       "a Python with vLLM's CUDA build (pip install vllm==0.32.0)" >&2
  exit 1
fi
OUT="${1:-runs/gpu-check-$(date +%Y%m%d-%H%M%S)}"  # a new folder: a run refuses one holding a run
"$TRAIN" -m tiller train configs/calculator.yaml --output-dir "$OUT" \
  engine.backend=vllm "engine.python=$VLLM" model.device=cuda \
  engine.kv_cache_bytes=1073741824
"$TRAIN" - "$OUT" <<'PY'
import json, sys
rows = [json.loads(l) for l in open(f"{sys.argv[1]}/metrics.jsonl")]
rl = [r for r in rows if r["phase"] == "rl"]
tokens, seconds = sum(r["rollout_tokens"] for r in rl), sum(r["rollout_s"] for r in rl)
print(f"rollout tokens/s {tokens / seconds:.0f}; sync s median "
      f"{sorted(r['sync/time_s'] for r in rl)[len(rl) // 2]:.3f}; "
      f"logp mismatch max {max(r['logp_mismatch_max'] for r in rl):.2e}")
PY
