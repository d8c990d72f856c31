#!/bin/bash
# LLaMA-2 7B pretraining, bf16, on one node of 8 GPUs (80 GB):
#   DATA_PATH=/data/corpus_text_document TOKENIZER_MODEL=/models/llama2/tokenizer.model \
#       bash examples/pretrain_llama2_7b.sh
# Multi-node: run it on every node with NNODES=N MASTER_ADDR=<first node>; with Slurm use
# examples/pretrain_llama2_7b_slurm.sh. See examples/_llama_common.sh for the environment.
#
# Layout: TP=4 x PP=1, DP = 2 per node. Per GPU: 1.75B parameters x 18 bytes (bf16 weights, fp32
# main grads, fp32 main params, Adam moments) = 32 GB, plus about 9 GB of activations at micro-batch
# 1 and sequence 4096 without recompute.
NAME=${NAME:-llama2_7b}
: "${TOKENIZER_MODEL:?set TOKENIZER_MODEL to the SentencePiece tokenizer.model of LLaMA-2}"

MODEL_ARGS=(
    --num-layers 32 --hidden-size 4096 --ffn-hidden-size 11008 --num-attention-heads 32
    --seq-length 4096 --max-position-embeddings 4096 --norm-epsilon 1e-5 --rotary-base 10000
    --init-method-std 0.01
    --tokenizer-type Llama2Tokenizer --tokenizer-model "$TOKENIZER_MODEL"
    # 32000 rows exactly (divisible by TP), so the weights convert to HuggingFace unpadded.
    --make-vocab-size-divisible-by 1
)
PARALLEL_ARGS=(--tensor-model-parallel-size 4 --pipeline-model-parallel-size 1)
# 1024 x 4096 = 4M tokens per iteration; 500k iterations = 2T tokens (the LLaMA-2 recipe).
TRAIN_ARGS=(
    --micro-batch-size 1 --global-batch-size 1024 --train-iters 500000
    --lr 3e-4 --min-lr 3e-5 --lr-warmup-iters 2000
)

source "$(dirname "${BASH_SOURCE[0]}")/_llama_common.sh"
launch_llama "$@"
