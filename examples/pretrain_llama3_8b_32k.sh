#!/bin/bash
# Llama-3 8B long-context pretraining (32768 tokens), bf16, on one node of 8 GPUs (80 GB), with
# context parallelism: each sequence split over 2 ranks.
#   DATA_PATH=/data/corpus_text_document TOKENIZER_DIR=/models/Meta-Llama-3-8B \
#       bash examples/pretrain_llama3_8b_32k.sh
# (TOKENIZER_DIR: a local folder with Llama 3's tokenizer.json; nothing is downloaded.)
# Multi-node: NNODES=N MASTER_ADDR=<first node> on every node. See examples/_llama_common.sh.
#
# Layout: tools/plan.py's first for this shape on 8 x 80 GB: TP=2 x CP=2 x PP=1, DP = 2 per node
# (WORLD_SIZE = TP x CP x PP x DP). Each rank holds 16384 tokens of every sequence (chunks i and
# 3 - i of 4), split again over TP by --sequence-parallel; attention all-gathers keys and values
# over the CP pair (Llama 3's context parallelism; --cp-comm-type p2p is the ring). It estimates
# 71.9 GiB per GPU (7.5 parameters, 15.0 fp32 gradients, 11.2 optimizer sharded over DP x CP, 38.2
# activations); TP=2 x CP=2 x PP=2 (this recipe's earlier layout, 56.5 GiB) 4% slower.
#   python tools/plan.py --num-gpus 8 --gpu-memory-gib 80 --num-layers 32 --hidden-size 4096 \
#       --ffn-hidden-size 14336 --num-attention-heads 32 --num-query-groups 8 --vocab-size 128256 \
#       --make-vocab-size-divisible-by 1 --untie-embeddings-and-output-weights \
#       --global-batch-size 128 --seq-length 32768
NAME=${NAME:-llama3_8b_32k}
: "${TOKENIZER_DIR:?set TOKENIZER_DIR to a local folder holding Llama 3 tokenizer.json}"

MODEL_ARGS=(
    --num-layers 32 --hidden-size 4096 --ffn-hidden-size 14336 --num-attention-heads 32
    --group-query-attention --num-query-groups 8
    --seq-length 32768 --max-position-embeddings 32768 --norm-epsilon 1e-5 --rotary-base 500000
    --init-method-std 0.01
    --tokenizer-type HuggingFaceTokenizer --tokenizer-name-or-path "$TOKENIZER_DIR"
    # 128256 rows exactly (divisible by any TP).
    --make-vocab-size-divisible-by 1
)
PARALLEL_ARGS=(
    --tensor-model-parallel-size 2 --pipeline-model-parallel-size 1 --sequence-parallel
    --context-parallel-size 2 --cp-comm-type all_gather --use-distributed-optimizer
)
# 128 x 32768 = 4M tokens per iteration.
TRAIN_ARGS=(
    --micro-batch-size 1 --global-batch-size 128 --train-iters 100000
    --lr 3e-4 --min-lr 3e-5 --lr-warmup-iters 2000
)

source "$(dirname "${BASH_SOURCE[0]}")/_llama_common.sh"
launch_llama "$@"
