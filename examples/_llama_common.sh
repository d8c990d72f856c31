# Sourced by examples/pretrain_llama*.sh (not run directly): the flags every LLaMA recipe shares
# and the launcher. The sourcing script sets MODEL_ARGS, PARALLEL_ARGS and TRAIN_ARGS (bash arrays)
# and then calls `launch_llama`.
#
# Environment:
#   DATA_PATH        (required) prefix of a dataset made by tools/preprocess_data.py (PREFIX.bin and
#                    PREFIX.idx), or a blend "0.3 PREFIX_A 0.7 PREFIX_B"
#   MOCK_DATA=1      instead of DATA_PATH: train on synthetic tokens (--mock-data), to smoke-test
#                    the launch, the layout and the memory before any data is prepared
#   CHECKPOINT_DIR   checkpoints are saved here and resumed from here (default ./checkpoints/$NAME)
#   TENSORBOARD_DIR  TensorBoard events (default ./tensorboard/$NAME)
#   GPUS_PER_NODE    processes per node (default 8)
#   NNODES, MASTER_ADDR, MASTER_PORT, RDZV_ID, NODE_RANK
#                    plain multi-node torchrun (NNODES > 1): run the same command on every node
#                    with the same MASTER_ADDR (any one node) and a MASTER_PORT (default 29500)
#                    and RDZV_ID (default $NAME) no other job on that node uses; torchrun's c10d
#                    rendezvous assigns the node ranks. NODE_RANK=0 on MASTER_ADDR's node (others
#                    any other number) makes that node host the rendezvous or fail, naming
#                    MASTER_PORT, when the port is taken, instead of joining whatever job holds it.
#                    One node (NNODES unset or 1): torchrun --standalone, on a free port and a
#                    rendezvous of its own, so two jobs on one machine never join each other.
#   LAUNCHER         torchrun (default) or slurm (set by the *_slurm.sh scripts: one srun task per
#                    node, each starting torchrun with the c10d rendezvous on the first node, on a
#                    MASTER_PORT derived from SLURM_JOB_ID, 10000 + SLURM_JOB_ID % 20000, unless
#                    given: jobs sharing a node keep apart).

set -euo pipefail

if [ "${MOCK_DATA:-}" != 1 ]; then
    : "${DATA_PATH:?set DATA_PATH to the prefix of a preprocessed dataset (PREFIX.bin, PREFIX.idx), or MOCK_DATA=1}"
fi
REPO=${REPO:-${SLURM_SUBMIT_DIR:-$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)}}
CHECKPOINT_DIR=${CHECKPOINT_DIR:-checkpoints/$NAME}
TENSORBOARD_DIR=${TENSORBOARD_DIR:-tensorboard/$NAME}
GPUS_PER_NODE=${GPUS_PER_NODE:-8}
NNODES=${NNODES:-1}

# LLaMA's architecture, in Megatron-LM's and Megatron-LLaMA's words.
LLAMA_ARGS=(
    --normalization RMSNorm --swiglu --position-embedding-type rope --no-position-embedding
    --disable-bias-linear --untie-embeddings-and-output-weights
    --hidden-dropout 0 --attention-dropout 0
)

# AdamW as in the LLaMA-2 paper: beta2 0.95, eps 1e-5, weight decay 0.1, clip 1.0, cosine to 10%.
OPTIMIZER_ARGS=(
    --adam-beta1 0.9 --adam-beta2 0.95 --adam-eps 1e-5 --weight-decay 0.1 --clip-grad 1.0
    --lr-decay-style cosine --bf16
)

# $DATA_PATH is left unquoted on purpose: a blend is several words.
# shellcheck disable=SC2206
if [ "${MOCK_DATA:-}" = 1 ]; then
    DATA_ARGS=(--mock-data --data-impl mmap --num-workers 2)
else
    DATA_ARGS=(--data-path $DATA_PATH --split 969,30,1 --data-impl mmap --num-workers 2)
fi

OUTPUT_ARGS=(
    --save "$CHECKPOINT_DIR" --load "$CHECKPOINT_DIR" --save-interval 1000
    --log-interval 10 --eval-interval 1000 --eval-iters 10
    --tensorboard-dir "$TENSORBOARD_DIR" --log-timers-to-tensorboard
    --log-batch-size-to-tensorboard --log-validation-ppl-to-tensorboard
    --distributed-backend nccl --distributed-timeout-minutes 30
)

# Exit 2 naming MASTER_PORT when something on this machine already listens on it (pure bash:
# a connection to it succeeds).
check_master_port_free() {
    if (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null; then
        echo "MASTER_PORT=$1 is already in use on this machine (another job?): choose another MASTER_PORT" >&2
        exit 2
    fi
}

launch_llama() {
    local args=("${LLAMA_ARGS[@]}" "${MODEL_ARGS[@]}" "${PARALLEL_ARGS[@]}" "${TRAIN_ARGS[@]}"
                "${OPTIMIZER_ARGS[@]}" "${DATA_ARGS[@]}" "${OUTPUT_ARGS[@]}" "$@")
    if [ "${LAUNCHER:-torchrun}" = slurm ]; then
        : "${SLURM_JOB_ID:?the slurm launcher runs inside an allocation: submit with sbatch}"
        local hosts
        mapfile -t hosts < <(scontrol show hostnames "$SLURM_JOB_NODELIST")
        local master=${hosts[0]}
        # below Linux's ephemeral ports (32768-60999), so no connection of the node holds it
        local port=${MASTER_PORT:-$(( 10000 + SLURM_JOB_ID % 20000 ))}
        srun --ntasks-per-node=1 --kill-on-bad-exit=1 \
            torchrun --nnodes "$SLURM_JOB_NUM_NODES" --nproc_per_node "$GPUS_PER_NODE" \
            --rdzv_id "$SLURM_JOB_ID" --rdzv_backend c10d --rdzv_endpoint "$master:$port" \
            "$REPO/pretrain_llama.py" "${args[@]}"
    elif [ "$NNODES" -gt 1 ]; then
        : "${MASTER_ADDR:?set MASTER_ADDR to the address of the first node, on every node (NNODES=$NNODES)}"
        local port=${MASTER_PORT:-29500} host=()
        if [ "${NODE_RANK:-}" = 0 ]; then
            check_master_port_free "$port"
            host=(--rdzv_conf is_host=1)
        elif [ -n "${NODE_RANK:-}" ]; then
            host=(--rdzv_conf is_host=0)
        fi
        torchrun --nnodes "$NNODES" --nproc_per_node "$GPUS_PER_NODE" \
            --rdzv_id "${RDZV_ID:-$NAME}" --rdzv_backend c10d \
            --rdzv_endpoint "$MASTER_ADDR:$port" ${host[@]+"${host[@]}"} \
            "$REPO/pretrain_llama.py" "${args[@]}"
    else
        torchrun --standalone --nproc_per_node "$GPUS_PER_NODE" "$REPO/pretrain_llama.py" "${args[@]}"
    fi
}
