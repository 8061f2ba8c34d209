#!/usr/bin/env bash
# tools/gpu_memory.py refuses bad arguments before any work: exit 2, one line on stderr naming the
# value, nothing written. Needs no GPU and no PyTorch. Usage: gpu_memory_args_test.sh
set -u
tool=$(realpath "$(dirname "$0")/gpu_memory.py")
box=$(mktemp -d) guard=$(mktemp -d)
trap 'rm -rf "$box" "$guard"' EXIT
failures=0
# A torch that fails on import, found first: a refusal must come before PyTorch is imported.
mkdir "$guard/torch"
echo 'raise SystemExit("torch imported before the arguments were checked")' >"$guard/torch/__init__.py"

# bad TEXT ARGS...: one row.
bad() {
  local text=$1
  shift
  (cd "$box" && PYTHONPATH="$guard" timeout 60 python3 "$tool" "$@" >"$box/.out" 2>"$box/.err" </dev/null)
  local rc=$? why=""
  if [ "$rc" -ne 2 ]; then why="exit $rc, not 2"
  elif [ "$(grep -c . "$box/.err")" -ne 1 ]; then why="$(grep -c . "$box/.err") lines on stderr, not 1"
  elif ! grep -qF -- "$text" "$box/.err"; then why="stderr lacks '$text'"
  elif [ -s "$box/.out" ]; then why="it printed a result"
  elif [ "$(ls -A "$box" | grep -v '^\.out$\|^\.err$')" ]; then why="it wrote $(ls -A "$box")"
  fi
  if [ -n "$why" ]; then
    echo "FAIL: gpu_memory.py $*: $why: $(cat "$box/.err")"
    failures=$((failures + 1))
  fi
}

bad "--events ev.txt: needs --trace" --events ev.txt --json out.json
bad "--trace: records the CUDA allocator" --smoke --trace --events ev.txt
bad "--layers 0: must be at least 1" --layers 0 --json out.json
bad "--warmup -1: must be at least 0" --warmup -1
bad "--suite needs --json FILE" --suite
bad "invalid choice: 'llama3-1b'" --model llama3-1b --json out.json

[ "$failures" -eq 0 ] && echo "gpu_memory.py: 6 bad inputs refused" || exit 1
