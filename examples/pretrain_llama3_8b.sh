#!/bin/bash
# Llama-3 8B pretraining, bf16, on one node of 8 GPUs (80 GB):
#   DATA_PATH=/data/corpus_text_document TOKENIZER_DIR=/models/Meta-Llama-3-8B \
#       bash examples/pretrain_llama3_8b.sh
# (TOKENIZER_DIR: a local folder with Llama 3's tokenizer.json; nothing is downloaded.)
# Multi-node: NNODES=N MASTER_ADDR=<first node> on every node, or
# examples/pretrain_llama3_8b_slurm.sh. See examples/_llama_common.sh for the environment.
#
# Layout: tools/plan.py's first for this shape on 8 x 80 GB: TP=1 x CP=2 x PP=1, DP = 4 per
# node, with the distributed optimizer (sharded over DP x CP = 8). Each sequence of 8192 tokens is
# split over 2 ranks (chunks i and 3 - i of 4, a ring exchange of keys and values). Per GPU it
# estimates 75.1 GiB (of 80, with 4 kept back): 15.0 bf16 parameters, 29.9 fp32 gradients,
# 11.2 optimizer state, 19.0 activations; TP=4 without the distributed optimizer (this recipe's
# earlier layout) 22% slower. Short of memory, add --recompute-activations (selective: -9.5 GiB of
# activations by its estimate). GQA: 32 heads in 8 groups.
#   python tools/plan.py --num-gpus 8 --gpu-memory-gib 80 --num-layers 32 --hidden-size 4096 \
#       --ffn-hidden-size 14336 --num-attention-heads 32 --num-query-groups 8 --vocab-size 128256 \
#       --make-vocab-size-divisible-by 1 --untie-embeddings-and-output-weights \
#       --global-batch-size 512 --seq-length 8192
NAME=${NAME:-llama3_8b}
: "${TOKENIZER_DIR:?set TOKENIZER_DIR to a local folder holding Llama 3 tokenizer.json}"

MODEL_ARGS=(
    --num-layers 32 --hidden-size 4096 --ffn-hidden-size 14336 --num-attention-heads 32
    --group-query-attention --num-query-groups 8
    --seq-length 8192 --max-position-embeddings 8192 --norm-epsilon 1e-5 --rotary-base 500000
    --init-method-std 0.01
    --tokenizer-type HuggingFaceTokenizer --tokenizer-name-or-path "$TOKENIZER_DIR"
    # 128256 rows exactly (divisible by any TP).
    --make-vocab-size-divisible-by 1
)
PARALLEL_ARGS=(
    --tensor-model-parallel-size 1 --pipeline-model-parallel-size 1
    --context-parallel-size 2 --cp-comm-type p2p
    --use-distributed-optimizer --overlap-grad-reduce --overlap-param-gather
)
# 512 x 8192 = 4M tokens per iteration.
TRAIN_ARGS=(
    --micro-batch-size 1 --global-batch-size 512 --train-iters 500000
    --lr 3e-4 --min-lr 3e-5 --lr-warmup-iters 2000
)

source "$(dirname "${BASH_SOURCE[0]}")/_llama_common.sh"
launch_llama "$@"
