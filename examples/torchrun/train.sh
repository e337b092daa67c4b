#!/bin/bash
# Train a lightning-par config on several machines with torchrun: run this same line on every node.
#
#   NNODES=2 NPROC_PER_NODE=8 RDZV_ENDPOINT=node1:29500 examples/torchrun/train.sh configs/hybrid3d.yaml
#
# torchrun's c10d rendezvous assigns node ranks; --max-restarts restarts the whole group after a failure
# and --ckpt_path=auto resumes it from the newest complete checkpoint (a fresh start when there is none yet).
set -euo pipefail
CONFIG=${1:?usage: NNODES=.. NPROC_PER_NODE=.. RDZV_ENDPOINT=host:port examples/torchrun/train.sh CONFIG.yaml [options]}
shift
exec torchrun --nnodes="${NNODES:-1}" --nproc-per-node="${NPROC_PER_NODE:-1}" --max-restarts="${MAX_RESTARTS:-3}" \
    --rdzv-backend=c10d --rdzv-endpoint="${RDZV_ENDPOINT:-127.0.0.1:29500}" --rdzv-id="${RDZV_ID:-lightning-par}" \
    -m lightning_par.cli fit --config "$CONFIG" --trainer.num_nodes="${NNODES:-1}" \
    --trainer.devices="${NPROC_PER_NODE:-1}" --ckpt_path=auto "$@"
