#!/bin/bash
# LLaMA-2 13B pretraining, bf16, on one node of 8 GPUs (80 GB):
#   DATA_PATH=/data/corpus_text_document TOKENIZER_MODEL=/models/llama2/tokenizer.model \
#       bash examples/pretrain_llama2_13b.sh
# Multi-node: NNODES=N MASTER_ADDR=<first node> on every node, or
# examples/pretrain_llama2_13b_slurm.sh. See examples/_llama_common.sh for the environment.
#
# Layout: TP=4 x PP=2 (one model per node), DP = number of nodes. Per GPU: 1.6B parameters x 18
# bytes = 29 GB, plus about 14 GB of activations (20 layers, up to 2 micro-batches in flight).
NAME=${NAME:-llama2_13b}
: "${TOKENIZER_MODEL:?set TOKENIZER_MODEL to the SentencePiece tokenizer.model of LLaMA-2}"

MODEL_ARGS=(
    --num-layers 40 --hidden-size 5120 --ffn-hidden-size 13824 --num-attention-heads 40
    --seq-length 4096 --max-position-embeddings 4096 --norm-epsilon 1e-5 --rotary-base 10000
    --init-method-std 0.01
    --tokenizer-type Llama2Tokenizer --tokenizer-model "$TOKENIZER_MODEL"
    --make-vocab-size-divisible-by 1
)
PARALLEL_ARGS=(--tensor-model-parallel-size 4 --pipeline-model-parallel-size 2)
TRAIN_ARGS=(
    --micro-batch-size 1 --global-batch-size 1024 --train-iters 500000
    --lr 3e-4 --min-lr 3e-5 --lr-warmup-iters 2000
)

source "$(dirname "${BASH_SOURCE[0]}")/_llama_common.sh"
launch_llama "$@"
