#!/bin/bash
# Mixtral-8x7B-shaped mixture-of-experts pretraining, bf16, on 4 nodes of 8 GPUs (80 GB). Plain
# torchrun: run on every node
#   NNODES=4 MASTER_ADDR=<first node> DATA_PATH=/data/corpus_text_document \
#       TOKENIZER_MODEL=/models/Mixtral-8x7B/tokenizer.model bash examples/pretrain_mixtral_8x7b.sh
# (TOKENIZER_MODEL: Mixtral's SentencePiece tokenizer.model; nothing is downloaded.) MOCK_DATA=1
# smoke-tests the launch without data. See examples/_llama_common.sh for the environment and
# docs/moe.md for the MoE flags.
#
# Shape: 32 layers, hidden 4096, 32 heads in 8 key/value groups, every layer an MoE layer of 8
# SwiGLU experts of width 14336, top-2 (the softmax of the two top logits, Mixtral's routing),
# vocabulary 32000, RoPE base 1e6: 46.7B parameters, 12.9B active per token.
#
# Layout: tools/plan.py's first for this shape on 32 x 80 GB: TP=1 x CP=2 x PP=4, DP = 4, with
# the experts split over EP=2 (folded over CP x DP: each rank holds 4 of the 8 experts of its 8
# layers, expert-TP 1, expert-DP 4) and the distributed optimizer. Per GPU it estimates 64.3 GiB
# (of 80, with 4 kept back): 11.4 bf16 parameters, 22.7 fp32 gradients, 16.4 optimizer state,
# 13.8 activations; 13.6 s per iteration, of which 0.34 s the experts' all-to-all. Short of
# memory, EP=4 (48.5 GiB by its estimate, 0.7% slower).
#   python tools/plan.py --num-gpus 32 --gpu-memory-gib 80 --num-layers 32 --hidden-size 4096 \
#       --ffn-hidden-size 14336 --num-attention-heads 32 --num-query-groups 8 --vocab-size 32000 \
#       --make-vocab-size-divisible-by 1 --untie-embeddings-and-output-weights \
#       --num-experts 8 --moe-router-topk 2 --global-batch-size 512 --seq-length 4096
NAME=${NAME:-mixtral_8x7b}
NNODES=${NNODES:-4}
: "${TOKENIZER_MODEL:?set TOKENIZER_MODEL to the Mixtral SentencePiece tokenizer.model}"

MODEL_ARGS=(
    --num-layers 32 --hidden-size 4096 --ffn-hidden-size 14336 --num-attention-heads 32
    --group-query-attention --num-query-groups 8
    --seq-length 4096 --max-position-embeddings 32768 --norm-epsilon 1e-5 --rotary-base 1000000
    --init-method-std 0.02
    --tokenizer-type Llama2Tokenizer --tokenizer-model "$TOKENIZER_MODEL"
    # 32000 rows exactly (divisible by any TP), so the weights convert to HuggingFace unpadded.
    --make-vocab-size-divisible-by 1
)
MOE_ARGS=(
    --num-experts 8 --moe-ffn-hidden-size 14336 --moe-router-topk 2
    --moe-router-load-balancing-type aux_loss --moe-aux-loss-coeff 0.02
    --moe-token-dispatcher-type alltoall --moe-grouped-gemm
)
PARALLEL_ARGS=(
    --tensor-model-parallel-size 1 --pipeline-model-parallel-size 4
    --context-parallel-size 2 --cp-comm-type p2p
    --expert-model-parallel-size 2 --expert-tensor-parallel-size 1
    --use-distributed-optimizer --overlap-grad-reduce --overlap-param-gather
    "${MOE_ARGS[@]}"
)
# 512 x 4096 = 2M tokens per iteration.
TRAIN_ARGS=(
    --micro-batch-size 1 --global-batch-size 512 --train-iters 500000
    --lr 3e-4 --min-lr 3e-5 --lr-warmup-iters 2000
)

source "$(dirname "${BASH_SOURCE[0]}")/_llama_common.sh"
launch_llama "$@"
