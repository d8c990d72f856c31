#!/bin/bash
# LLaMA-2 7B pretraining, bf16, on one node of 8 GPUs (80 GB):
#   DATA_PATH=/data/corpus_text_document TOKENIZER_MODEL=/models/llama2/tokenizer.model \
#       bash examples/pretrain_llama2_7b.sh
# Multi-node: run it on every node with NNODES=N MASTER_ADDR=<first node>; with Slurm use
# examples/pretrain_llama2_7b_slurm.sh. See examples/_llama_common.sh for the environment.
#
# Layout: tools/plan.py's first for this shape on 8 x 80 GB (the command below): TP=1 x PP=1,
# DP = 8 per node, with the distributed optimizer (ZeRO-1). Per GPU it estimates 63.7 GiB: 12.6
# bf16 parameters, 25.1 fp32 gradients, 9.4 optimizer state (fp32 main parameters and Adam
# moments, 1/8 each), 16.6 activations at micro-batch 1 and sequence 4096 without recompute.
# TP=4 without the distributed optimizer (this recipe's earlier layout) it estimates 30% slower.
#   python tools/plan.py --num-gpus 8 --gpu-memory-gib 80 --num-layers 32 --hidden-size 4096 \
#       --ffn-hidden-size 11008 --num-attention-heads 32 --vocab-size 32000 \
#       --make-vocab-size-divisible-by 1 --untie-embeddings-and-output-weights \
#       --global-batch-size 1024 --seq-length 4096
NAME=${NAME:-llama2_7b}
: "${TOKENIZER_MODEL:?set TOKENIZER_MODEL to the SentencePiece tokenizer.model of LLaMA-2}"

MODEL_ARGS=(
    --num-layers 32 --hidden-size 4096 --ffn-hidden-size 11008 --num-attention-heads 32
    --seq-length 4096 --max-position-embeddings 4096 --norm-epsilon 1e-5 --rotary-base 10000
    --init-method-std 0.01
    --tokenizer-type Llama2Tokenizer --tokenizer-model "$TOKENIZER_MODEL"
    # 32000 rows exactly (divisible by any TP), so the weights convert to HuggingFace unpadded.
    --make-vocab-size-divisible-by 1
)
PARALLEL_ARGS=(
    --tensor-model-parallel-size 1 --pipeline-model-parallel-size 1
    --use-distributed-optimizer --overlap-grad-reduce --overlap-param-gather
)
# 1024 x 4096 = 4M tokens per iteration; 500k iterations = 2T tokens (the LLaMA-2 recipe).
TRAIN_ARGS=(
    --micro-batch-size 1 --global-batch-size 1024 --train-iters 500000
    --lr 3e-4 --min-lr 3e-5 --lr-warmup-iters 2000
)

source "$(dirname "${BASH_SOURCE[0]}")/_llama_common.sh"
launch_llama "$@"
