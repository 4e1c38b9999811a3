#!/usr/bin/env bash
# Seconds from `inferd serve` to its READY line, a few times, for the checkout (or checkouts) given:
#     bash bench/server_start.sh [CHECKOUT ...]      (default: this one; each needs its .venv)
# The model is the tiny random Llama the test suite saves ($TINY, default: the latest pytest run's tiny-llama0).
set -u
TINY=${TINY:-$(ls -d /tmp/pytest-of-*/pytest-current/tiny-llama0 2>/dev/null | head -1)}
[ -n "$TINY" ] || { echo "set TINY to a model folder (run the tests once: they save tiny-llama0)"; exit 2; }
for dir in "${@:-.}"; do
  (cd "$dir" && for i in 1 2 3 4; do
    out=$(mktemp)
    s=$(date +%s.%N)
    .venv/bin/python -m inferd serve --model "$TINY" --port 0 --dtype float32 --state-dir "" > "$out" 2>/dev/null &
    pid=$!
    while ! grep -q READY "$out"; do sleep 0.05; done
    e=$(date +%s.%N)
    echo "$dir: ready in $(echo "$e - $s" | bc) s"
    kill $pid; wait $pid 2>/dev/null; rm -f "$out"; sleep 1
  done)
done
