#!/usr/bin/env bash
# End-to-end checks of the remat CLI: bad input gets one line on stderr and exit code 2; a tiny
# bench writes its files. Usage: cli_test.sh path/to/remat
set -u
remat=$1
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

expect_error 2 "unknown policy term 'atn'" bench "${tiny[@]}" --policies none,atn
expect_error 2 "every:K needs a positive integer, got '0'" bench "${tiny[@]}" --policies every:0
expect_error 2 "--dim 16 is not divisible by --heads 3" bench "${tiny[@]}" --heads 3
expect_error 2 "--layers must be a positive integer, got 0" bench "${tiny[@]}" --layers 0
expect_error 2 "--batch must be a positive integer, got -1" bench "${tiny[@]}" --batch -1
expect_error 2 "cannot write '/nonexistent-dir/r.json'" bench "${tiny[@]}" --json /nonexistent-dir/r.json
expect_error 2 "unknown format '.jpg'" bench "${tiny[@]}" --chart "$tmp/c.jpg"
expect_error 2 "unknown --arch 'gpt5'; allowed: seed, gpt2" bench "${tiny[@]}" --arch gpt5
expect_error 2 "--threads 'x'" bench "${tiny[@]}" --threads x
expect_error 2 "recomputes only some tensors" bench "${tiny[@]}" --policies attn --engine module
expect_error 2 "The following argument was not expected: --bogus" bench --bogus
expect_error 2 "--budget is required" plan --layers 2 --dim 16 --heads 4 --seq 8 --batch 2
expect_error 2 "bad budget unit 'XB' in '12XB'" plan --layers 2 --dim 16 --heads 4 --seq 8 --batch 2 --budget 12XB
expect_error 2 "unknown --model 'gpt5'" plan --model gpt5 --budget 1GB
expect_error 2 "cannot be met: the smallest peak any policy reaches is" plan --model gpt3-175b --budget 80GB
expect_error 2 "unknown tensor 'ln9'" plan --layers 2 --dim 16 --heads 4 --seq 8 --batch 2 --budget 1GB --pins keep:ln9
expect_error 2 "--steps must be >= 1, got 0" train --steps 0
expect_error 2 "cannot read --data '/nonexistent/t.txt'" train --data /nonexistent/t.txt
expect_error 2 "unknown policy term 'atn'" train --policy atn
expect_error 2 "remat train trains token models" train --arch seed
expect_error 2 "cannot read train state '/nonexistent/state.bin'" train --resume /nonexistent
expect_error 2 "cannot read train state '/nonexistent/state.bin'" sample --load /nonexistent
expect_error 2 "--load is required" sample

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

# The llama block runs on the engine, every recompute verified bitwise.
"$remat" bench --arch llama --kv-heads 2 --dropout 0.1 "${tiny[@]}" --policies none,attn,mlp-act,norm,full --verify \
  --json "$tmp/llama.json" >"$tmp/out" 2>"$tmp/err" || { echo "FAIL: llama bench: $(cat "$tmp/err")"; failures=$((failures + 1)); }

# Math and flash attention in one run, every recompute verified; attn has nothing to drop under flash.
"$remat" bench --arch gpt2 --dropout 0.1 "${tiny[@]}" --attention math,flash --policies none,attn,full --verify \
  >"$tmp/out" 2>"$tmp/err" || { echo "FAIL: flash bench: $(cat "$tmp/err")"; failures=$((failures + 1)); }
grep -q "| full *| flash" "$tmp/out" || { echo "FAIL: no flash full row"; cat "$tmp/out"; failures=$((failures + 1)); }
grep -q "flash attention: 'attn' left out" "$tmp/out" || { echo "FAIL: attn under flash not noted"; failures=$((failures + 1)); }
expect_error 2 "--attention takes one of math, flash here, got 'math,flash'" train --attention math,flash
expect_error 2 "unknown --attention 'sdpa'" bench "${tiny[@]}" --attention sdpa

# A plan answers, in text and JSON, and its peak fits the budget.
"$remat" plan --layers 2 --dim 16 --heads 4 --seq 64 --batch 4 --budget 90% --costs estimated --json "$tmp/plan.json" \
  >"$tmp/plan.out" 2>"$tmp/plan.err" || { echo "FAIL: plan exit $?"; cat "$tmp/plan.err"; failures=$((failures + 1)); }
grep -q '"fits": true' "$tmp/plan.json" || { echo "FAIL: plan JSON"; cat "$tmp/plan.json"; failures=$((failures + 1)); }
grep -q "policy: " "$tmp/plan.out" || { echo "FAIL: plan prints no policy"; failures=$((failures + 1)); }

# Hostile sizes, values and files (issue 13): refused in one line before any work, never a hang.
expect_error 2 "--dim 99999999999 is over the limit 1048576" plan --dim 99999999999 --heads 1 --budget 1GB
expect_error 2 "--seq 3000000000 is over the limit 16777216" plan --seq 3000000000 --budget 1GB
expect_error 2 "--layers 100000000 is over the limit 16384" plan --layers 100000000 --budget 1GB
expect_error 2 "makes tensors of" plan --batch 16000000 --seq 16000000 --budget 1GB
expect_error 2 "--weight-decay must be a finite number >= 0, got nan" train --weight-decay nan --steps 1
expect_error 2 "--clip must be a finite number >= 0 (0 = off), got nan" train --clip nan --steps 1
expect_error 2 "--lr inf and --min-lr" train --lr inf --steps 1
expect_error 2 "--seed: must be a non-negative integer, got '-1'" train --seed -1 --steps 1
expect_error 2 "--json was given an empty value" bench "${tiny[@]}" --json ''
expect_error 2 "--data was given an empty value" train --data '' --steps 1
expect_error 2 "is not a regular file (a folder, FIFO or device)" train --data "$tmp" --steps 1
mkfifo "$tmp/fifo" "$tmp/fifo_state" && mkdir "$tmp/fifo_run" && mv "$tmp/fifo_state" "$tmp/fifo_run/state.bin"
expect_error 2 "is not a regular file (a folder, FIFO or device)" train --data "$tmp/fifo" --steps 1
expect_error 2 "is not a regular file (a FIFO, device or folder)" sample --load "$tmp/fifo_run"
expect_error 2 "--tokens must be in 0..1000000" sample --load "$tmp/fifo_run" --tokens 99999999999
expect_error 2 "with math attention, none (every bench's reference step) is predicted to peak at" bench --arch gpt2 --seq 65536 --batch 8 --policies none --steps 1 --warmup 0
printf 'tiny' > "$tmp/tiny.txt"
expect_error 2 "has 4 bytes; with --seq 128 and 10% held out it needs at least 1290" train --data "$tmp/tiny.txt" --steps 1

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

# Multi-GPU layouts: bad flags are refused before any search; a search prints layouts that fit and
# their breakdown; a request that cannot fit says the GPU count that does, and still writes JSON.
expect_error 2 "--device 'tpu9' is neither a preset (h100-80gb" plan --model gpt3-175b --gpus 64 --device tpu9
expect_error 2 "--tp 3 x --pp 2 x --dp 2 is 12 GPUs, not --gpus 8" plan --model gpt3-175b --gpus 8 --tp 3 --pp 2 --dp 2 --device h100-80gb
expect_error 2 "bad --grad-dtype 'fp8'" plan --model gpt3-175b --gpus 64 --device h100-80gb --grad-dtype fp8
expect_error 2 "--budget and --reserve both" plan --model gpt3-175b --gpus 64 --device h100-80gb --budget 70GiB --reserve 1GiB
expect_error 2 "is a budget; a layout plans each stage" plan --model gpt3-175b --gpus 64 --device h100-80gb --policies budget:50%
expect_error 2 "GPUs fit" plan --model gpt3-175b --gpus 8 --device a100-80gb --json "$tmp/refused.json"
grep -q '"fits": false' "$tmp/refused.json" && grep -q '"min_gpus": [1-9]' "$tmp/refused.json" && grep -q '"least"' "$tmp/refused.json" ||
  { echo "FAIL: refusal JSON"; head -c 600 "$tmp/refused.json"; failures=$((failures + 1)); }
"$remat" plan --model llama-70b --gpus 16 --device h100-80gb --json "$tmp/layouts.json" >"$tmp/layouts.out" 2>"$tmp/layouts.err" ||
  { echo "FAIL: plan --gpus 16 exit $?"; cat "$tmp/layouts.err"; failures=$((failures + 1)); }
grep -q "fastest layouts that fit" "$tmp/layouts.out" && grep -q "| every GPU\|| stage 0" "$tmp/layouts.out" &&
  grep -q "MFU" "$tmp/layouts.out" && grep -q '"fits": true' "$tmp/layouts.json" ||
  { echo "FAIL: plan --gpus 16 output"; cat "$tmp/layouts.out"; failures=$((failures + 1)); }

if [ $failures -ne 0 ]; then echo "$failures CLI check(s) failed"; exit 1; fi
echo "CLI checks passed"
