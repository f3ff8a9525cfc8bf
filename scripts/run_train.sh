#!/usr/bin/env bash
# Launch a training job with torchrun (python -m torchtitan_lite.launch: torchrun, ending with
# the exit code of docs/configuration.md's table); extra arguments are config overrides.
#
#   NGPU=8 CONFIG_FILE=train_configs/llama3_8b.toml ./scripts/run_train.sh --training.steps 100
#
# NGPU         processes on this machine (default: the number of GPUs, else 2 CPU processes)
# CONFIG_FILE  base TOML (default: train_configs/debug_model.toml)
# NNODES       machines in the job (default 1). With NNODES > 1, run this script on every
#              machine with the same RDZV_ENDPOINT=HOST:PORT (a host all of them reach) and
#              RDZV_ID; torchrun's c10d rendezvous then numbers the nodes itself.
# LOG_RANK     ranks whose output is shown, comma-separated (default 0)
set -euo pipefail
cd "$(dirname "$0")/.."

NGPU=${NGPU:-$(python -c "import torch; print(torch.cuda.device_count() or 2)")}
CONFIG_FILE=${CONFIG_FILE:-train_configs/debug_model.toml}
NNODES=${NNODES:-1}
LOG_RANK=${LOG_RANK:-0}

if [[ "$NNODES" == 1 ]]; then
    launch=(--standalone --nnodes=1)
else
    : "${RDZV_ENDPOINT:?set RDZV_ENDPOINT=HOST:PORT (the same on every node) when NNODES > 1}"
    launch=(--nnodes="$NNODES" --rdzv-backend=c10d --rdzv-endpoint="$RDZV_ENDPOINT"
            --rdzv-id="${RDZV_ID:-torchtitan_lite}")
fi

export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
exec python -m torchtitan_lite.launch "${launch[@]}" --nproc_per_node="$NGPU" \
    --local-ranks-filter="$LOG_RANK" --role=rank --tee=3 \
    -m torchtitan_lite.train --job.config_file "$CONFIG_FILE" "$@"
