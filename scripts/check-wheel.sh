#!/usr/bin/env bash
# The package as a user installs it: build the wheel, check that it holds every source and data file
# of the four roots (retrofit/, patches/, eval/, configs/), install it non-editable into a fresh
# environment that reuses the set-up venv's dependencies (no network), and from a folder outside
# the source tree run `retrofit --help`, `retrofit ls` and a tiny convert -> generate -> eval ppl.
#   bash scripts/check-wheel.sh        # after scripts/test.sh (or with RETROFIT_VENV set up)
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
MAIN="${RETROFIT_VENV:-$ROOT/.venv}"
[[ -x "$MAIN/bin/python" ]] || { echo "error: $MAIN is not set up; run scripts/test.sh first" >&2; exit 1; }
WORK="$(mktemp -d "${TMPDIR:-/tmp}/retrofit-wheel.XXXXXX")"
trap 'rm -rf "$WORK"' EXIT
PIP="$MAIN/bin/python -m pip --disable-pip-version-check -q"

echo "[wheel] building"
$PIP install "setuptools>=68" wheel   # the build backend, in the set-up venv (no isolated build env)
$PIP wheel --no-deps --no-build-isolation -w "$WORK/dist" "$ROOT" >/dev/null
WHEEL="$(ls "$WORK"/dist/retrofit-*.whl)"
echo "[wheel] $(basename "$WHEEL")"

# every tracked source/data file of the four roots is in the wheel, at its import path
"$MAIN/bin/python" - "$ROOT" "$WHEEL" <<'PY'
import subprocess, sys, zipfile
root, wheel = sys.argv[1], sys.argv[2]
names = set(zipfile.ZipFile(wheel).namelist())
where = {"retrofit/": "retrofit/", "patches/": "retrofit/patches/", "eval/": "retrofit/eval/", "configs/": "retrofit/configs/"}
tracked = subprocess.run(["git", "-C", root, "ls-files", *where], capture_output=True, text=True, check=True).stdout.split()
if not tracked:
    sys.exit("error: git lists no files under retrofit/ patches/ eval/ configs/ (not a git checkout?)")
kept = (".py", ".yaml", ".json", ".jsonl", ".txt")
missing = [f for f in tracked if f.endswith(kept) or f.startswith("retrofit/data/")
           for src, dst in where.items() if f.startswith(src) and dst + f[len(src):] not in names]
if missing:
    sys.exit("error: the wheel lacks " + ", ".join(missing[:20]) + (" ..." if len(missing) > 20 else "")
             + ": add the package to setup.py's roots or the files to [tool.setuptools.package-data]")
if not any(n.endswith("LICENSE") for n in names):
    sys.exit("error: the wheel carries no LICENSE")
print(f"[wheel] all {len(tracked)} tracked files of the four roots are in it")
PY

# a fresh environment: the wheel installed non-editable over the set-up venv's dependencies
# (a .pth line; the main venv's own .pth files, its editable retrofit among them, are not read)
"$MAIN/bin/python" -m venv --without-pip "$WORK/env"
MAIN_SITE="$("$MAIN/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
ENV_SITE="$("$WORK/env/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
echo "$MAIN_SITE" > "$ENV_SITE/_retrofit_deps.pth"
$PIP --python "$WORK/env/bin/python" install --no-deps --no-index "$WHEEL"

mkdir -p "$WORK/user" && cd "$WORK/user"
export PATH="$WORK/env/bin:$PATH" HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
python - "$ROOT" <<'PY'
import sys
from pathlib import Path
import retrofit
where = Path(retrofit.__file__).resolve()
assert Path(sys.argv[1]).resolve() not in where.parents, f"retrofit imported from the source tree: {where}"
print("[wheel] retrofit", retrofit.__version__, "from", where.parent)
PY
retrofit --help >/dev/null
retrofit ls >/dev/null
echo "[wheel] retrofit --help and retrofit ls run"

# a tiny LLaMA with a byte-level BPE tokenizer trained on a bundled book (found through the package)
python - tiny <<'PY'
import sys
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast
from retrofit.eval.corpora import list_local_files, resolve_corpus

book = next(f for f in list_local_files(resolve_corpus("pg-books")) if f.name == "moby-dick.txt")
tok = Tokenizer(models.BPE())
tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
tok.decoder = decoders.ByteLevel()
tok.train_from_iterator([book.read_text(encoding="utf-8")[:200_000]],
                        trainers.BpeTrainer(vocab_size=320, special_tokens=["<bos>", "<eos>"],
                                            initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<bos>", eos_token="<eos>")
cfg = LlamaConfig(vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=512, bos_token_id=0, eos_token_id=1)
torch.manual_seed(0)
LlamaForCausalLM(cfg).save_pretrained(sys.argv[1])
fast.save_pretrained(sys.argv[1])
PY
retrofit convert tiny --method macchiato --option window=16 --option latents=8 --out tiny-mac
retrofit generate tiny-mac --prompt "Call me Ishmael." --max-new-tokens 8 --device cpu
retrofit eval ppl tiny-mac --baseline tiny --datasets pg-books-heldout --lengths 64 128 --max-windows 2 --device cpu --out eval
test -s eval/results.json
echo "[wheel] ok: installed from the wheel, run from $WORK/user"
