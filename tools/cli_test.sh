#!/usr/bin/env bash
# End-to-end checks of the remat CLI: a tiny bench writes its files, every gradient is bitwise
# equal, plans answer, layouts search and refuse. (Bad input: bad_input_test.sh.)
# Usage: cli_test.sh path/to/remat
set -u
remat=$(realpath "$1")
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
failures=0
tiny=(--layers 2 --dim 16 --heads 4 --batch 2 --seq 8 --steps 1 --warmup 0)

# expect_error CODE TEXT ARGS...: exit code CODE, stderr one line containing TEXT.
expect_error() {
  local code=$1 text=$2
  shift 2
  "$remat" "$@" >"$tmp/out" 2>"$tmp/err"
  local rc=$?
  local lines
  lines=$(grep -c . "$tmp/err")
  if [ "$rc" -ne "$code" ] || ! grep -qF -- "$text" "$tmp/err" || [ "$lines" -ne 1 ]; then
    echo "FAIL: remat $* -> exit $rc (want $code), stderr:"; cat "$tmp/err"
    failures=$((failures + 1))
  fi
}

"$remat" bench "${tiny[@]}" --policies none,full --json "$tmp/r.json" --csv "$tmp/r.csv" \
  --chart "$tmp/r.svg" --markdown "$tmp/r.md" >"$tmp/out" 2>"$tmp/err"
rc=$?
if [ $rc -ne 0 ]; then echo "FAIL: tiny bench exit $rc"; cat "$tmp/err"; failures=$((failures + 1)); fi
for f in r.json r.csv r.svg r.md; do
  [ -s "$tmp/$f" ] || { echo "FAIL: $f not written"; failures=$((failures + 1)); }
done
# Every row's gradient difference must be exactly 0 (not 0.37, not NaN), and there must be rows.
diffs=$(grep -o '"grad_max_abs_diff": *[^,}]*' "$tmp/r.json" | sed 's/.*: *//')
[ -n "$diffs" ] && ! grep -qvx '0\(\.0\)\?' <<<"$diffs" ||
  { echo "FAIL: gradients differ: $(tr '\n' ' ' <<<"$diffs")"; failures=$((failures + 1)); }
grep -q "| full " "$tmp/out" || { echo "FAIL: no table on stdout"; failures=$((failures + 1)); }

# remat cpu: the CPU as the calibrations know it, and its kind, a folder name (its refusals:
# bad_input_test.sh).
"$remat" cpu >"$tmp/cpu" 2>"$tmp/err" && grep -q '^cpu: .' "$tmp/cpu" && grep -q '^kind: ' "$tmp/cpu" ||
  { echo "FAIL: remat cpu:"; cat "$tmp/cpu" "$tmp/err"; failures=$((failures + 1)); }
kind=$("$remat" cpu --kind 2>"$tmp/err")
grep -qxE '[A-Za-z0-9_]+-[A-Za-z0-9_]+-[A-Za-z0-9_]+(-(avx512|avx2|sse))?' <<<"$kind" &&
  grep -qxF "kind: $kind" "$tmp/cpu" ||
  { echo "FAIL: remat cpu --kind: '$kind'"; failures=$((failures + 1)); }

# User text never reaches a shell (a chart named with $(...) is only a name), and a device given as
# an output is written through, never replaced by a regular file.
(cd "$tmp" && "$remat" bench "${tiny[@]}" --policies none --engine ops --chart 'x$(touch pwned).svg' --json /dev/null \
  >/dev/null 2>"$tmp/err") || { echo "FAIL: bench with a \$(...) chart name: $(cat "$tmp/err")"; failures=$((failures + 1)); }
[ ! -e "$tmp/pwned" ] && [ -s "$tmp/x\$(touch pwned).svg" ] && [ -c /dev/null ] ||
  { echo "FAIL: a chart name ran a command, or the chart or /dev/null is wrong"; failures=$((failures + 1)); }

# The BLAS kernel: --blas-kernel NAME re-executes once with it and says so; a kernel the user set
# in OPENBLAS_CORETYPE is never changed.
kernel_line() { "$remat" bench "${tiny[@]}" --policies none --engine ops "$@" 2>/dev/null | grep '^  BLAS: '; }
# A kernel other than the one OpenBLAS loads here, so that forcing it must re-execute.
other=Sandybridge
kernel_line --blas-kernel keep | grep -q " Sandybridge " && other=Nehalem
kernel_line --blas-kernel $other | grep -q "$other .*(chosen with --blas-kernel; OpenBLAS picked" ||
  { echo "FAIL: --blas-kernel $other: $(kernel_line --blas-kernel $other)"; failures=$((failures + 1)); }
OPENBLAS_CORETYPE=Nehalem kernel_line --blas-kernel $other | grep -q "Nehalem .*forced by OPENBLAS_CORETYPE=Nehalem" ||
  { echo "FAIL: OPENBLAS_CORETYPE overridden"; failures=$((failures + 1)); }
# Commands that run no BLAS product load LibTorch once: --help, and plan with the engine on oneDNN
# (OpenBLAS prints "Core: NAME" each time it loads, under OPENBLAS_VERBOSE=2). A forced kernel
# makes bench load it twice, so the count can tell.
# loads WANT_RC ARGS...: the loads, or "exit N" when remat exits otherwise than WANT_RC.
loads() {
  local want=$1 out rc
  shift
  out=$(OPENBLAS_VERBOSE=2 "$remat" "$@" 2>&1 >/dev/null)
  rc=$?
  if [ "$rc" -ne "$want" ]; then echo "exit $rc"; else grep -c '^Core: ' <<<"$out"; fi
}
bench_loads=$(loads 0 bench "${tiny[@]}" --policies none --engine ops --blas-kernel $other)
help_loads=$(loads 0 --help)
plan_loads=$(loads 0 plan --layers 2 --dim 16 --heads 4 --seq 8 --budget 80% --blas-kernel $other)
[ "$bench_loads" = 2 ] && [ "$help_loads" = 1 ] && [ "$plan_loads" = 1 ] ||
  { echo "FAIL: LibTorch loads: bench $bench_loads, --help $help_loads, plan $plan_loads"; failures=$((failures + 1)); }
# Bad flags are refused before that second start: the options are checked first (Command::check).
for bad in "bench ${tiny[*]} --policies none,bogus" "bench ${tiny[*]} --engine ops --steps 0" \
           "train --layers 1 --dim 16 --heads 2 --seq 8 --batch 2 --steps 1 --lr -1" \
           "train --arch seed --steps 1" "sample --load $tmp/nowhere --top-k 999"; do
  # shellcheck disable=SC2086  # the row is words
  n=$(loads 2 $bad --blas-kernel $other)
  [ "$n" = 1 ] || { echo "FAIL: remat $bad loaded LibTorch $n times before refusing"; failures=$((failures + 1)); }
done

# The llama block runs on the engine, every recompute verified bitwise.
"$remat" bench --arch llama --kv-heads 2 --dropout 0.1 "${tiny[@]}" --policies none,attn,mlp-act,norm,full --verify \
  --json "$tmp/llama.json" >"$tmp/out" 2>"$tmp/err" || { echo "FAIL: llama bench: $(cat "$tmp/err")"; failures=$((failures + 1)); }

# Math and flash attention in one run, every recompute verified; attn has nothing to drop under flash.
"$remat" bench --arch gpt2 --dropout 0.1 "${tiny[@]}" --attention math,flash --policies none,attn,full --verify \
  >"$tmp/out" 2>"$tmp/err" || { echo "FAIL: flash bench: $(cat "$tmp/err")"; failures=$((failures + 1)); }
grep -q "| full *| flash" "$tmp/out" || { echo "FAIL: no flash full row"; cat "$tmp/out"; failures=$((failures + 1)); }
grep -q "flash attention: 'attn' left out" "$tmp/out" || { echo "FAIL: attn under flash not noted"; failures=$((failures + 1)); }

# A plan answers, in text and JSON, and its peak fits the budget.
"$remat" plan --layers 2 --dim 16 --heads 4 --seq 64 --batch 4 --budget 90% --costs estimated --json "$tmp/plan.json" \
  >"$tmp/plan.out" 2>"$tmp/plan.err" || { echo "FAIL: plan exit $?"; cat "$tmp/plan.err"; failures=$((failures + 1)); }
grep -q '"fits": true' "$tmp/plan.json" || { echo "FAIL: plan JSON"; cat "$tmp/plan.json"; failures=$((failures + 1)); }
grep -q "policy: " "$tmp/plan.out" || { echo "FAIL: plan prints no policy"; failures=$((failures + 1)); }

# What a run measured about this machine is cached and used again; --remeasure measures it again
# and replaces the entry (here the op costs a plan times: a marker put into the cached entry's
# source is printed while it is used, and gone once it is replaced).
costs_line() {
  REMAT_CACHE="$tmp/cache" "$remat" plan --layers 2 --dim 16 --heads 4 --seq 8 --batch 2 --budget 1GB "$@" \
    >"$tmp/costs.out" 2>&1 || { echo "exit $?"; return; }
  grep '^  costs: .*measured on this machine' "$tmp/costs.out" || echo "no costs line"
}
first=$(costs_line)
sed -i 's/"source": *"/&MARKER /' "$tmp"/cache/costs-*.json
marked=$(costs_line)
remeasured=$(costs_line --remeasure)
after=$(costs_line)
[[ $first != *"cached in"* && $first != "exit"* && $first != "no costs line" ]] &&
  [[ $marked == *"MARKER"*"cached in"* ]] &&
  [[ $remeasured != *"cached in"* && $remeasured != *MARKER* && $remeasured != "exit"* && $remeasured != "no costs line" ]] &&
  [[ $after == *"cached in"* && $after != *MARKER* ]] ||
  { echo "FAIL: op costs and --remeasure: '$first' / '$marked' / '$remeasured' / '$after'"; failures=$((failures + 1)); }

# Integers are decimal: a leading zero is not octal (CLI11 alone reads "010" as 8).
"$remat" plan --layers 010 --dim 16 --heads 4 --seq 8 --batch 2 --budget 90% --costs estimated >"$tmp/dec.out" 2>&1
grep -q "L=10 " "$tmp/dec.out" || { echo "FAIL: --layers 010 is not 10: $(head -1 "$tmp/dec.out")"; failures=$((failures + 1)); }

# --attention flash plans a fused kernel: none keeps fewer bytes than with math attention's T x T tensors.
none_saved() {
  "$remat" plan --arch gpt2 --layers 2 --dim 16 --heads 4 --seq 64 --batch 2 --budget 90% --costs estimated \
    --attention "$1" --json "$tmp/$1.json" >/dev/null 2>&1 || echo "plan --attention $1 failed" >&2
  sed -n '/"none_memory"/,/}/s/.*"saved": *\([0-9]*\).*/\1/p' "$tmp/$1.json"
}
math_saved=$(none_saved math)
flash_saved=$(none_saved flash)
if [ -z "$math_saved" ] || [ -z "$flash_saved" ] || [ "$flash_saved" -ge "$math_saved" ]; then
  echo "FAIL: flash saves '$flash_saved' bytes, math '$math_saved'"; failures=$((failures + 1))
fi

# Multi-GPU layouts: a search prints layouts that fit and their breakdown; a request that cannot
# fit says the GPU count that does, and still writes JSON.
expect_error 2 "GPUs fit" plan --model gpt3-175b --gpus 8 --device a100-80gb --json "$tmp/refused.json"
grep -q '"fits": false' "$tmp/refused.json" && grep -q '"min_gpus": [1-9]' "$tmp/refused.json" && grep -q '"least"' "$tmp/refused.json" ||
  { echo "FAIL: refusal JSON"; head -c 600 "$tmp/refused.json"; failures=$((failures + 1)); }
"$remat" plan --model llama2-70b --gpus 16 --device h100-80gb --json "$tmp/layouts.json" >"$tmp/layouts.out" 2>"$tmp/layouts.err" ||
  { echo "FAIL: plan --gpus 16 exit $?"; cat "$tmp/layouts.err"; failures=$((failures + 1)); }
grep -q "fastest layouts that fit" "$tmp/layouts.out" && grep -q "| every GPU\|| stage 0" "$tmp/layouts.out" &&
  grep -q "MFU" "$tmp/layouts.out" && grep -q '"fits": true' "$tmp/layouts.json" ||
  { echo "FAIL: plan --gpus 16 output"; cat "$tmp/layouts.out"; failures=$((failures + 1)); }

# A --budget is per GPU: the devices offered instead are those with at least that much memory (the
# A100 40GB cannot hold a 46 GiB peak; the A100 80GB can).
expect_error 2 "at 1 GPUs, a100-80gb fit" plan --model llama2-7b --layers 12 --gpus 1 --tp 1 --pp 1 --dp 1 \
  --micro-batch 1 --global-batch 1 --policies full --device h100-80gb --budget 48.7GiB

# --pure-bf16 keeps the gradients in bf16 too: 2 bytes each, not Megatron's fp32 buffers.
"$remat" plan --model llama2-7b --gpus 8 --device h100-80gb --policies full --tp 2 --dp 4 --zero 1 --pp 1 \
  --pure-bf16 --json "$tmp/pure.json" >/dev/null 2>&1 || echo "plan --pure-bf16 failed" >&2
grep -q '"grad_bytes": 2' "$tmp/pure.json" ||
  { echo "FAIL: --pure-bf16 planned gradients of other than 2 bytes"; failures=$((failures + 1)); }

# A GPU plan runs flash attention unless --attention says math (the frameworks planned fuse it), and
# the default policies leave out those with nothing to drop there (a listed one is refused:
# bad_input_test.sh); --device cpu plans the engine's math.
small=(--arch llama --layers 2 --dim 256 --heads 4 --seq 256 --vocab 1024 --dtype bf16 --global-batch 8 --top 1)
head_of() { "$remat" plan "${small[@]}" "$@" 2>&1 | head -3; }
grep -q "attention=flash" <<<"$(head_of --gpus 8 --device h100-80gb)" &&
  grep -q "policies: none, full, auto; attn, attn+mlp-act left out" <<<"$(head_of --gpus 8 --device h100-80gb)" ||
  { echo "FAIL: a GPU plan without --attention is not flash with the default policies trimmed"; failures=$((failures + 1)); }
# (Each also needs its plan's header: a refusal has neither word either.)
math=$(head_of --gpus 8 --device h100-80gb --attention math)
grep -q "^remat plan: llama" <<<"$math" && ! grep -q "attention=flash\|left out" <<<"$math" ||
  { echo "FAIL: --attention math was not kept"; echo "$math"; failures=$((failures + 1)); }
cpu=$(head_of --gpus 2 --device cpu --arch gpt2 --dtype fp32 --dim 64 --seq 32 --global-batch 16)
grep -q "^remat plan: gpt2" <<<"$cpu" && ! grep -q "attention=flash" <<<"$cpu" ||
  { echo "FAIL: --device cpu planned flash attention"; echo "$cpu"; failures=$((failures + 1)); }

if [ $failures -ne 0 ]; then echo "$failures CLI check(s) failed"; exit 1; fi
echo "CLI checks passed"
