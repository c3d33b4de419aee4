#!/usr/bin/env bash
# Launch `retrofit train` on one node or many. Extra arguments are recipe overrides (section.key=value).
#
#   scripts/pretrain.sh configs/gemma2-2b-macchiato.yaml                      # all GPUs of this node
#   NGPUS=2 scripts/pretrain.sh configs/gemma2-2b-macchiato.yaml train.lr=3e-4
#   HOSTFILE=hostfile scripts/pretrain.sh configs/llama2-7b-exp-linear.yaml   # many nodes (DeepSpeed launcher)
#   LAUNCHER=torchrun NNODES=2 NODE_RANK=0 MASTER_ADDR=node0 scripts/pretrain.sh RECIPE   # many nodes, torchrun
#                                                                             # (run on every node, NODE_RANK=0..)
#   NGPUS=0 scripts/pretrain.sh configs/gemma3-270m-macchiato-cpu.yaml       # one CPU process, no launcher
#
# hostfile (DeepSpeed format, one line per node; needs passwordless ssh and the same paths everywhere):
#   node0 slots=8
#   node1 slots=8
# OUTPUT_DIR (checkpoint.output_dir) must be on a file system all nodes share: every rank writes its
# optimizer shard into the checkpoint folder and rank 0 renames it into place when all are done.
set -euo pipefail
RECIPE="${1:?usage: scripts/pretrain.sh RECIPE.yaml [section.key=value ...]}"
shift
LAUNCHER="${LAUNCHER:-deepspeed}"
MASTER_PORT="${MASTER_PORT:-29500}"
if [[ -z "${NGPUS:-}" ]]; then
  NGPUS="$(python -c 'import torch; print(torch.cuda.device_count())')"
fi
export TOKENIZERS_PARALLELISM=false

if [[ "$NGPUS" == "0" && -z "${HOSTFILE:-}" ]]; then
  exec retrofit train "$RECIPE" "$@"
fi

if [[ "$LAUNCHER" == "torchrun" ]]; then
  exec torchrun --nnodes "${NNODES:-1}" --node_rank "${NODE_RANK:-0}" --nproc_per_node "$NGPUS" \
    --master_addr "${MASTER_ADDR:-127.0.0.1}" --master_port "$MASTER_PORT" \
    -m retrofit.cli.main train "$RECIPE" "$@"
fi

# DeepSpeed launcher: --no_local_rank because retrofit reads LOCAL_RANK from the environment.
if [[ -n "${HOSTFILE:-}" ]]; then
  exec deepspeed --hostfile "$HOSTFILE" --master_port "$MASTER_PORT" --no_local_rank \
    --module retrofit.cli.main train "$RECIPE" "$@"
fi
exec deepspeed --num_gpus "$NGPUS" --master_port "$MASTER_PORT" --no_local_rank \
  --module retrofit.cli.main train "$RECIPE" "$@"
