#!/bin/bash
# Llama-3 8B pretraining, bf16, on one node of 8 GPUs (80 GB):
#   DATA_PATH=/data/corpus_text_document TOKENIZER_DIR=/models/Meta-Llama-3-8B \
#       bash examples/pretrain_llama3_8b.sh
# (TOKENIZER_DIR: a local folder with Llama 3's tokenizer.json; nothing is downloaded.)
# Multi-node: NNODES=N MASTER_ADDR=<first node> on every node, or
# examples/pretrain_llama3_8b_slurm.sh. See examples/_llama_common.sh for the environment.
#
# Layout: TP=4 x PP=1, DP = 2 per node. Per GPU: 2B parameters x 18 bytes = 36 GB, plus about
# 17 GB of activations at micro-batch 1 and sequence 8192. GQA: 32 heads in 8 groups.
NAME=${NAME:-llama3_8b}
: "${TOKENIZER_DIR:?set TOKENIZER_DIR to a local folder holding Llama 3 tokenizer.json}"

MODEL_ARGS=(
    --num-layers 32 --hidden-size 4096 --ffn-hidden-size 14336 --num-attention-heads 32
    --group-query-attention --num-query-groups 8
    --seq-length 8192 --max-position-embeddings 8192 --norm-epsilon 1e-5 --rotary-base 500000
    --init-method-std 0.01
    --tokenizer-type HuggingFaceTokenizer --tokenizer-name-or-path "$TOKENIZER_DIR"
    # 128256 rows exactly (divisible by TP).
    --make-vocab-size-divisible-by 1
)
PARALLEL_ARGS=(--tensor-model-parallel-size 4 --pipeline-model-parallel-size 1)
# 512 x 8192 = 4M tokens per iteration.
TRAIN_ARGS=(
    --micro-batch-size 1 --global-batch-size 512 --train-iters 500000
    --lr 3e-4 --min-lr 3e-5 --lr-warmup-iters 2000
)

source "$(dirname "${BASH_SOURCE[0]}")/_llama_common.sh"
launch_llama "$@"
