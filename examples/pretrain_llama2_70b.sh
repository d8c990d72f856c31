#!/bin/bash
# LLaMA-2 70B pretraining, bf16, on 8 nodes of 8 GPUs (80 GB). Plain torchrun: run on every node
#   NNODES=8 MASTER_ADDR=<first node> DATA_PATH=/data/corpus_text_document \
#       TOKENIZER_MODEL=/models/llama2/tokenizer.model bash examples/pretrain_llama2_70b.sh
# or submit examples/pretrain_llama2_70b_slurm.sh. See examples/_llama_common.sh.
#
# Layout: TP=8 (within a node) x PP=8 (across nodes), DP = nodes / 8. Per GPU: 1.1B parameters x 18
# bytes = 20 GB, plus about 35 GB of activations on the first stage (10 layers, up to 8
# micro-batches in flight). GQA: 64 heads in 8 key/value groups, one group per TP rank.
NAME=${NAME:-llama2_70b}
NNODES=${NNODES:-8}
: "${TOKENIZER_MODEL:?set TOKENIZER_MODEL to the SentencePiece tokenizer.model of LLaMA-2}"

MODEL_ARGS=(
    --num-layers 80 --hidden-size 8192 --ffn-hidden-size 28672 --num-attention-heads 64
    --group-query-attention --num-query-groups 8
    --seq-length 4096 --max-position-embeddings 4096 --norm-epsilon 1e-5 --rotary-base 10000
    --init-method-std 0.007
    --tokenizer-type Llama2Tokenizer --tokenizer-model "$TOKENIZER_MODEL"
    --make-vocab-size-divisible-by 1
)
PARALLEL_ARGS=(--tensor-model-parallel-size 8 --pipeline-model-parallel-size 8)
TRAIN_ARGS=(
    --micro-batch-size 1 --global-batch-size 1024 --train-iters 500000
    --lr 1.5e-4 --min-lr 1.5e-5 --lr-warmup-iters 2000
)

source "$(dirname "${BASH_SOURCE[0]}")/_llama_common.sh"
launch_llama "$@"
