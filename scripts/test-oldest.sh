#!/usr/bin/env bash
# A focused test subset on the OLDEST transformers that pyproject.toml accepts (the lower bound of
# "transformers>=X,<6"), so that bound stays true. It runs in its own venv layered over the main
# one (a .pth line exposes the main venv's packages; only transformers and what its pin needs are
# installed on top), so it costs one small wheel install, not a second torch.
#   bash scripts/test-oldest.sh            # after scripts/test.sh (or with RETROFIT_VENV set up)
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
MAIN="${RETROFIT_VENV:-$ROOT/.venv}"
OLD="${RETROFIT_OLDEST_VENV:-$ROOT/.venv-oldest}"
MIN="$(sed -n 's/^ *"transformers>=\([0-9.]*\),.*/\1/p' "$ROOT/pyproject.toml")"
[[ -n "$MIN" ]] || { echo "error: no transformers lower bound found in pyproject.toml" >&2; exit 1; }
[[ -x "$MAIN/bin/python" ]] || { echo "error: $MAIN is not set up; run scripts/test.sh first" >&2; exit 1; }
if [[ ! -x "$OLD/bin/python" ]]; then
  echo "[oldest] creating $OLD over $MAIN"
  "$MAIN/bin/python" -m venv --without-pip "$OLD"
fi
MAIN_SITE="$("$MAIN/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
OLD_SITE="$("$OLD/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
echo "$MAIN_SITE" > "$OLD_SITE/_retrofit_main_venv.pth"
# the main venv's editable retrofit is found through its own .pth files, which site does not read
# from a .pth-added folder: point at the worktree directly
for f in "$MAIN_SITE"/__editable__*retrofit*.pth "$MAIN_SITE"/_retrofit*.pth; do
  [[ -f "$f" && "$(basename "$f")" != "_retrofit_main_venv.pth" ]] && cp "$f" "$OLD_SITE/"
done
cp "$MAIN_SITE"/__editable___retrofit*finder.py "$OLD_SITE/" 2>/dev/null || true
echo "[oldest] transformers==$MIN"
"$MAIN/bin/python" -m pip --disable-pip-version-check -q --python "$OLD/bin/python" install "transformers==$MIN"
"$OLD/bin/python" -c "
import transformers, retrofit
want = '$MIN'.split('.')
assert transformers.__version__.split('.')[:len(want)] == want, transformers.__version__
print('[oldest] transformers', transformers.__version__, '/ retrofit from', retrofit.__file__)"
cd "$ROOT"
# identity (Auto classes, pipeline, PEFT-free), checkpoints, the SWA anchor, the decoding cache (and
# Macchiato's: decoding slots, sinks) and the RoPE cap on kept full-attention layers (mask interface,
# cached prefill, decoding), and activation checkpointing (whose method name changed after 5.17)
exec "$OLD/bin/python" -m pytest -q -p no:cacheprovider \
  tests/surgery/test_hf_identity.py tests/surgery/test_checkpoint.py tests/test_cache.py \
  tests/methods/test_macchiato.py tests/surgery/test_rope_cap.py tests/surgery/test_recompute.py "$@"
