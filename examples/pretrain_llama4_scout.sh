#!/bin/bash
# Llama-4-Scout-shaped mixture-of-experts pretraining (the text model), bf16, on 4 nodes of 8
# H200 GPUs (141 GB). Plain torchrun: run on every node
#   NNODES=4 MASTER_ADDR=<first node> DATA_PATH=/data/corpus_text_document \
#       TOKENIZER_DIR=/models/Llama-4-Scout-17B-16E bash examples/pretrain_llama4_scout.sh
# (TOKENIZER_DIR: a folder with Llama 4's tokenizer.json; nothing is downloaded.) MOCK_DATA=1
# smoke-tests the launch without data. See examples/_llama_common.sh for the environment,
# docs/llama4.md for the architecture flags and docs/moe.md for the MoE flags.
#
# Shape: 48 layers, hidden 5120, 40 heads in 8 key/value groups of width 128, every layer an
# MoE layer of 16 SwiGLU experts of width 8192, top-1 with a sigmoid of the kept logit on the
# expert's input, one shared expert of width 8192; every 4th layer a NoPE layer (full causal
# attention, temperature-scaled queries), the others chunked attention of 8192 tokens with the
# q/k L2 norm and interleaved RoPE (base 5e5, Llama-3 scaling factor 16); vocabulary 202048:
# 107.8B parameters, 17.2B active per token (tools/plan.py --model llama4-scout).
#
# Layout: tools/plan.py's first for this shape on 32 x 141 GiB: TP=1 x CP=4 x PP=2, DP = 4,
# with the experts split over EP=8 (folded over CP x DP: each rank holds 2 of the 16 experts of
# its 24 layers, expert-TP 1) and the distributed optimizer. Per GPU it estimates 123.2 GiB (of
# 141, with 4 kept back): 21.6 bf16 parameters, 43.2 fp32 gradients, 37.6 optimizer state,
# 20.7 activations (the all-to-all dispatch's kept rows included; at CP=2 they no longer fit).
# On H100 (80 GB) nodes it needs 8 nodes (TP=1 x CP=4 x PP=4, DP = 4, EP=8: 75.2 GiB).
#   python tools/plan.py --model llama4-scout --num-gpus 32 --gpu-memory-gib 141 \
#       --global-batch-size 512 --seq-length 8192
NAME=${NAME:-llama4_scout}
NNODES=${NNODES:-4}
: "${TOKENIZER_DIR:?set TOKENIZER_DIR to a folder holding the Llama 4 tokenizer.json}"

MODEL_ARGS=(
    --num-layers 48 --hidden-size 5120 --ffn-hidden-size 16384 --num-attention-heads 40
    --group-query-attention --num-query-groups 8 --kv-channels 128
    --seq-length 8192 --max-position-embeddings 262144 --norm-epsilon 1e-5 --rotary-base 500000
    --use-rope-scaling --rope-scaling-factor 16 --rope-scaling-low-freq-factor 1
    --rope-scaling-high-freq-factor 1 --rope-scaling-original-max-position-embeddings 8192
    --rotary-interleaved --qk-l2-norm --no-rope-freq 4 --attention-chunk-size 8192
    --attn-temperature-tuning --attn-temperature-floor-scale 8192 --attn-temperature-scale 0.1
    --untie-embeddings-and-output-weights --init-method-std 0.02
    --tokenizer-type HuggingFaceTokenizer --tokenizer-name-or-path "$TOKENIZER_DIR"
    # 202048 rows exactly (divisible by any TP up to 64), so the weights convert to
    # HuggingFace unpadded.
    --make-vocab-size-divisible-by 1
)
MOE_ARGS=(
    --num-experts 16 --moe-ffn-hidden-size 8192 --moe-router-topk 1
    --moe-router-score-function sigmoid --moe-apply-probs-on-input
    --moe-shared-expert-intermediate-size 8192
    --moe-router-load-balancing-type aux_loss --moe-aux-loss-coeff 1e-3
    --moe-token-dispatcher-type alltoall --moe-grouped-gemm
)
PARALLEL_ARGS=(
    --tensor-model-parallel-size 1 --pipeline-model-parallel-size 2
    --context-parallel-size 4 --cp-comm-type p2p
    --expert-model-parallel-size 8 --expert-tensor-parallel-size 1
    --use-distributed-optimizer --overlap-grad-reduce --overlap-param-gather
    "${MOE_ARGS[@]}"
)
# 512 x 8192 = 4M tokens per iteration.
TRAIN_ARGS=(
    --micro-batch-size 1 --global-batch-size 512 --train-iters 250000
    --lr 3e-4 --min-lr 3e-5 --lr-warmup-iters 2000
)

source "$(dirname "${BASH_SOURCE[0]}")/_llama_common.sh"
launch_llama "$@"
