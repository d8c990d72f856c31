#!/bin/bash
# Qwen3-30B-A3B-shaped mixture-of-experts pretraining, bf16, on 2 nodes of 8 GPUs (80 GB). Plain
# torchrun: run on every node
#   NNODES=2 MASTER_ADDR=<first node> DATA_PATH=/data/corpus_text_document \
#       TOKENIZER_DIR=/models/Qwen3-30B-A3B bash examples/pretrain_qwen3_30b_a3b.sh
# (TOKENIZER_DIR: a local folder with the Qwen3 tokenizer.json; nothing is downloaded.) MOCK_DATA=1
# smoke-tests the launch without data. See examples/_llama_common.sh for the environment and
# docs/moe.md for the MoE flags.
#
# Shape: 48 layers, hidden 2048, 32 query heads of 128 channels (--kv-channels 128: 4096 wide,
# more than the hidden size) in 4 key/value groups, every layer an MoE layer of 128 SwiGLU
# experts of width 768, top-8; Qwen3's norm_topk_prob=True (the 8 probabilities renormalised) is
# our default routing, the softmax of the 8 top logits. Vocabulary 151936, RoPE base 1e6: 30.5B
# parameters, 3.3B active per token. Qwen3 also normalises each head's queries and keys
# (RMSNorm per head before RoPE: --qk-layernorm), so the checkpoints convert to Qwen3's.
#
# Layout: tools/plan.py's first for this shape on 16 x 80 GB (expert-TP 1): TP=1 x CP=2 x PP=2,
# DP = 4, the experts split over EP=4 (folded over CP x DP: each rank holds 32 of the 128
# experts of its 24 layers), with the distributed optimizer. Per GPU it estimates 70.6 GiB (of
# 80, with 4 kept back): 8.2 bf16 parameters, 16.4 fp32 gradients, 21.3 optimizer state, 24.7
# activations (the all-to-all dispatch's kept rows of the top-8 routing included: with them
# EP=1 x PP=4 no longer fits); 12.3 s per iteration.
#   python tools/plan.py --num-gpus 16 --gpu-memory-gib 80 --num-layers 48 --hidden-size 2048 \
#       --ffn-hidden-size 6144 --num-attention-heads 32 --num-query-groups 4 --kv-channels 128 \
#       --vocab-size 151936 --make-vocab-size-divisible-by 1 \
#       --untie-embeddings-and-output-weights --num-experts 128 --moe-ffn-hidden-size 768 \
#       --moe-router-topk 8 --expert-tensor-parallel-size 1 --global-batch-size 512 \
#       --seq-length 4096
NAME=${NAME:-qwen3_30b_a3b}
NNODES=${NNODES:-2}
: "${TOKENIZER_DIR:?set TOKENIZER_DIR to a local folder holding the Qwen3 tokenizer.json}"

MODEL_ARGS=(
    # --ffn-hidden-size: Qwen3's dense intermediate_size, unused (every layer is MoE).
    --num-layers 48 --hidden-size 2048 --ffn-hidden-size 6144 --num-attention-heads 32
    --kv-channels 128 --group-query-attention --num-query-groups 4 --qk-layernorm
    --seq-length 4096 --max-position-embeddings 40960 --norm-epsilon 1e-6 --rotary-base 1000000
    --init-method-std 0.02
    --tokenizer-type HuggingFaceTokenizer --tokenizer-name-or-path "$TOKENIZER_DIR"
    # 151936 rows exactly (divisible by any TP up to 8), as Qwen3's embedding.
    --make-vocab-size-divisible-by 1
)
MOE_ARGS=(
    --num-experts 128 --moe-ffn-hidden-size 768 --moe-router-topk 8
    --moe-router-load-balancing-type aux_loss --moe-aux-loss-coeff 0.001
    --moe-token-dispatcher-type alltoall --moe-grouped-gemm
)
PARALLEL_ARGS=(
    --tensor-model-parallel-size 1 --pipeline-model-parallel-size 2
    --context-parallel-size 2 --cp-comm-type p2p
    --expert-model-parallel-size 4 --expert-tensor-parallel-size 1
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
