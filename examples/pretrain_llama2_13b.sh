#!/bin/bash
# LLaMA-2 13B pretraining, bf16, on one node of 8 GPUs (80 GB):
#   DATA_PATH=/data/corpus_text_document TOKENIZER_MODEL=/models/llama2/tokenizer.model \
#       bash examples/pretrain_llama2_13b.sh
# Multi-node: NNODES=N MASTER_ADDR=<first node> on every node, or
# examples/pretrain_llama2_13b_slurm.sh. See examples/_llama_common.sh for the environment.
#
# Layout: tools/plan.py's first for this shape on 8 x 80 GB: TP=1 x PP=4 (10 layers per stage),
# DP = 2 per node, with the distributed optimizer. Per GPU it estimates 62.5 GiB: 6.2 bf16
# parameters, 12.4 fp32 gradients, 18.6 optimizer state, 25.2 activations (first stage, 4
# micro-batches in flight); TP=4 x PP=2 without it (this recipe's earlier layout) 22% slower.
#   python tools/plan.py --num-gpus 8 --gpu-memory-gib 80 --num-layers 40 --hidden-size 5120 \
#       --ffn-hidden-size 13824 --num-attention-heads 40 --vocab-size 32000 \
#       --make-vocab-size-divisible-by 1 --untie-embeddings-and-output-weights \
#       --global-batch-size 1024 --seq-length 4096
NAME=${NAME:-llama2_13b}
: "${TOKENIZER_MODEL:?set TOKENIZER_MODEL to the SentencePiece tokenizer.model of LLaMA-2}"

MODEL_ARGS=(
    --num-layers 40 --hidden-size 5120 --ffn-hidden-size 13824 --num-attention-heads 40
    --seq-length 4096 --max-position-embeddings 4096 --norm-epsilon 1e-5 --rotary-base 10000
    --init-method-std 0.01
    --tokenizer-type Llama2Tokenizer --tokenizer-model "$TOKENIZER_MODEL"
    # 32000 rows exactly (divisible by any TP), so the weights convert to HuggingFace unpadded.
    --make-vocab-size-divisible-by 1
)
PARALLEL_ARGS=(
    --tensor-model-parallel-size 1 --pipeline-model-parallel-size 4
    --use-distributed-optimizer --overlap-grad-reduce --overlap-param-gather
)
TRAIN_ARGS=(
    --micro-batch-size 1 --global-batch-size 1024 --train-iters 500000
    --lr 3e-4 --min-lr 3e-5 --lr-warmup-iters 2000
)

source "$(dirname "${BASH_SOURCE[0]}")/_llama_common.sh"
launch_llama "$@"
