#!/bin/bash
# LLaMA-2 70B pretraining, bf16, on 8 nodes of 8 GPUs (80 GB). Plain torchrun: run on every node
#   NNODES=8 MASTER_ADDR=<first node> DATA_PATH=/data/corpus_text_document \
#       TOKENIZER_MODEL=/models/llama2/tokenizer.model bash examples/pretrain_llama2_70b.sh
# or submit examples/pretrain_llama2_70b_slurm.sh. See examples/_llama_common.sh.
#
# Layout: TP=8 (within a node) x PP=8 (across nodes), DP = nodes / 8. Per GPU: 1.1B parameters x 18
# bytes = 20 GB, plus about 35 GB of activations on the first stage (10 layers, up to 8
# micro-batches in flight). GQA: 64 heads in 8 key/value groups, one group per TP rank.
#
# Not tools/plan.py's first layout: for this shape on 64 x 80 GB it ranks TP=1 x CP=8 x PP=8 x DP=1,
# micro-batch 1, distributed optimizer first (71 s per iteration, 72.1 GiB per GPU by its
# estimate) and this TP=8 x PP=8 about 36% slower.
# Its cost model assumes the same 45% MFU for every per-rank shape (--mfu); CP=8 leaves 512 tokens
# of each 4096-token sequence per rank (attention in 256-token chunks), the shape at which that
# assumption is least safe, and no measurement of it exists here. Until one on such a cluster
# says otherwise, this recipe keeps the tensor x pipeline layout of Megatron-style
# 70B training (TP within a node's NVLink, PP across nodes) and leaves CP for long contexts (see
# examples/pretrain_llama3_8b_32k.sh). Compare with
#   python tools/plan.py --num-gpus 64 --gpu-memory-gib 80 --num-layers 80 --hidden-size 8192 \
#       --ffn-hidden-size 28672 --num-attention-heads 64 --num-query-groups 8 --vocab-size 32000 \
#       --make-vocab-size-divisible-by 1 --untie-embeddings-and-output-weights \
#       --global-batch-size 1024 --seq-length 4096 --top 100
NAME=${NAME:-llama2_70b}
NNODES=${NNODES:-8}
: "${TOKENIZER_MODEL:?set TOKENIZER_MODEL to the SentencePiece tokenizer.model of LLaMA-2}"

MODEL_ARGS=(
    --num-layers 80 --hidden-size 8192 --ffn-hidden-size 28672 --num-attention-heads 64
    --group-query-attention --num-query-groups 8
    --seq-length 4096 --max-position-embeddings 4096 --norm-epsilon 1e-5 --rotary-base 10000
    --init-method-std 0.007
    --tokenizer-type Llama2Tokenizer --tokenizer-model "$TOKENIZER_MODEL"
    # 32000 rows exactly (divisible by any TP), so the weights convert to HuggingFace unpadded.
    --make-vocab-size-divisible-by 1
)
PARALLEL_ARGS=(--tensor-model-parallel-size 8 --pipeline-model-parallel-size 8)
TRAIN_ARGS=(
    --micro-batch-size 1 --global-batch-size 1024 --train-iters 500000
    --lr 1.5e-4 --min-lr 1.5e-5 --lr-warmup-iters 2000
)

source "$(dirname "${BASH_SOURCE[0]}")/_llama_common.sh"
launch_llama "$@"
