# Sourced by the CPU demos (examples/pretrain_llama_cpu_demo.sh, examples/sft_llama_cpu_demo.sh;
# not run directly) after they set ROOT and cd into it: the steps both share.
#
#   demo_python MODULES...   sets PYTHON (PYTHON given, an active virtualenv, or ./.venv created),
#                            installs torch==2.13.0 unless that version is there, and this package
#                            (pip install -e .) unless `import megatron MODULES...` works; any
#                            MODULES that are not ours are installed beside it
#   demo_tokenizer CACHE_DIR sets TOKENIZER to CACHE_DIR/data/tokenizer.model.v1, the 32k
#                            SentencePiece model of `pip download --no-deps mistral-common==1.13.1`
#                            (read from the wheel as a zip, never installed)
#   rendezvous [OFFSET]      torchrun's rendezvous flag: --standalone (a free port of its own), or
#                            --master-port=MASTER_PORT+OFFSET after checking nothing listens there
#                            (a port in use: one line naming MASTER_PORT, status 2)

demo_python() {
    if [[ -z "${PYTHON:-}" ]]; then
        if [[ -n "${VIRTUAL_ENV:-}" ]]; then
            PYTHON="$VIRTUAL_ENV/bin/python"
        else
            [[ -x .venv/bin/python ]] || python3 -m venv .venv
            PYTHON="$ROOT/.venv/bin/python"
        fi
    fi
    if ! "$PYTHON" -c "import torch, sys; sys.exit(0 if torch.__version__.startswith('2.13.0') else 1)" 2>/dev/null; then
        "$PYTHON" -m pip install "torch==2.13.0"
    fi
    local modules
    modules=$(IFS=,; echo "$*")
    local extra=()
    for m in "$@"; do
        case "$m" in sentencepiece|tensorboard) ;; yaml) extra+=(pyyaml) ;; *) extra+=("$m") ;; esac
    done
    "$PYTHON" -c "import megatron${modules:+, $modules}" 2>/dev/null || "$PYTHON" -m pip install -e . "${extra[@]}"
}

demo_tokenizer() {
    local cache="$1"
    mkdir -p "$cache/pip" "$cache/data"
    TOKENIZER="$cache/data/tokenizer.model.v1"
    if [[ ! -f "$TOKENIZER" ]]; then
        "$PYTHON" -m pip download --no-deps mistral-common==1.13.1 -d "$cache/pip"
        "$PYTHON" - "$cache/pip" "$TOKENIZER" <<'PY'
import glob, sys, zipfile
wheel = glob.glob(f"{sys.argv[1]}/mistral_common-1.13.1-*.whl")[0]
with zipfile.ZipFile(wheel) as z, open(sys.argv[2], "wb") as out:
    out.write(z.read("mistral_common/data/tokenizer.model.v1"))
PY
    fi
}

rendezvous() {
    if [[ -z "${MASTER_PORT:-}" ]]; then
        echo --standalone
        return
    fi
    local port=$(( MASTER_PORT + ${1:-0} ))
    if (exec 3<>"/dev/tcp/127.0.0.1/$port") 2>/dev/null; then
        echo "MASTER_PORT=$MASTER_PORT: port $port is already in use on this machine (another job?): choose another MASTER_PORT, or unset it to let torchrun pick a free one" >&2
        return 2
    fi
    echo "--master-port=$port"
}
