#!/bin/bash
# End-to-end fault checks with the real embedded model, in a private cache and temporary directory.
# Run from the repository root: bash benchmarks/fault_checks.sh   (about a minute; results in
# benchmarks/results/reliability.md). Ctrl-C and SIGTERM are covered by tests/test_faults.py:
# a non-interactive shell starts background jobs with SIGINT ignored.
PYTHON=${PYTHON:-.venv/bin/python}
WORK=$(mktemp -d)
export TMPDIR=$WORK/tmp
mkdir -p "$TMPDIR"
run() { XDG_CACHE_HOME=$1 "$PYTHON" main.py --max-tokens 5 --json "${@:2}"; }
models() { ls -a "$1/mlx-decoding/models/" | tr '\n' ' '; echo; }

echo "== two processes on an empty cache"
run "$WORK/c1" > "$WORK/a.out" & A=$!
run "$WORK/c1" > "$WORK/b.out" & B=$!
wait $A; STATUS_A=$?; wait $B; echo "exit statuses: $STATUS_A and $?"; "$PYTHON" -c "
import json, sys; a, b = (json.load(open(name))['tokens'] for name in sys.argv[1:]); print('same tokens:', a == b)
" "$WORK/a.out" "$WORK/b.out"
models "$WORK/c1"

echo "== SIGKILL during the first conversion, then a rerun"
run "$WORK/c2" > /dev/null & K=$!
until ls "$WORK/c2/mlx-decoding/models/" 2>/dev/null | grep -q converting; do sleep 0.2; done
sleep 2; kill -9 $K; wait $K 2>/dev/null; models "$WORK/c2"
run "$WORK/c2" > /dev/null; echo "rerun exit status: $?"; models "$WORK/c2"

echo "== unwritable cache (under a regular file)"
touch "$WORK/file"
run "$WORK/file/cache" | head -c 40; echo " exit status: ${PIPESTATUS[0]}"; ls -a "$TMPDIR" | tr '\n' ' '; echo

echo "== same-size damage to the cached weights"
"$PYTHON" -c "
import sys; f = open(sys.argv[1], 'r+b'); f.seek(f.seek(0, 2) // 2); f.write(bytes(4096))
" "$WORK/c2/mlx-decoding/models/SmolLM2-135M-Instruct-float32/model.safetensors"
run "$WORK/c2" | head -c 40; echo " exit status: ${PIPESTATUS[0]}"; models "$WORK/c2"

echo "== closed pipe and full disk"
XDG_CACHE_HOME=$WORK/c2 "$PYTHON" main.py --max-tokens 60 | head -c 10; echo " exit status: ${PIPESTATUS[0]}"
run "$WORK/c2" > /dev/full; echo "exit status: $?"
rm -rf "$WORK"
