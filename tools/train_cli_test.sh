#!/usr/bin/env bash
# kill -9 in the middle of `remat train --save`, then --resume: the final weights must equal those
# of an uninterrupted run (same digest). Usage: train_cli_test.sh path/to/remat
set -u
remat=$(realpath "$1")
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
fail() { echo "FAIL: $*"; exit 1; }

for i in $(seq 1 3000); do echo "line $i: the fox and the dog met $((i * 7 % 13)) times by the river."; done > "$tmp/text.txt"
args=(--layers 2 --dim 32 --heads 4 --batch 4 --seq 32 --dropout 0.1 --steps 600 --eval-every 0
      --data "$tmp/text.txt" --threads 1/1)

"$remat" train "${args[@]}" > "$tmp/straight.out" 2> "$tmp/straight.err" || fail "uninterrupted run: $(cat "$tmp/straight.err")"
want=$(sed -n 's/.*weights digest: //p' "$tmp/straight.out")
[ -n "$want" ] || fail "no weights digest in: $(cat "$tmp/straight.out")"

"$remat" train "${args[@]}" --save "$tmp/run" --save-every 10 > /dev/null 2>&1 &
pid=$!
# The state file appears by rename, complete: kill as soon as there is one, mid-run.
for _ in $(seq 1 1000); do [ -f "$tmp/run/state.bin" ] && break; sleep 0.01; done
kill -9 "$pid" 2>/dev/null
wait "$pid" 2>/dev/null
[ -f "$tmp/run/state.bin" ] || fail "no train state was written before the kill"
step=$(grep -a -o '"step":[0-9]*' "$tmp/run/state.bin" | head -1 | cut -d: -f2)
[ -n "$step" ] && [ "$step" -lt 600 ] || fail "the run finished (step $step) before kill -9; the test needs a longer run"

# SIGTERM (as Ctrl-C, a scheduler's stop) ends a run with --save and no --save-every after the step
# under way, saving it first: exit 128 + 15, and the run resumes to the uninterrupted weights.
"$remat" train "${args[@]}" --save "$tmp/stopped" > /dev/null 2> "$tmp/stopped.err" &
pid=$!
for _ in $(seq 1 3000); do grep -q '^step [0-9]' "$tmp/stopped.err" 2>/dev/null && break; sleep 0.01; done
kill -TERM "$pid"
wait "$pid"
rc=$?
at=$(grep -a -o '"step":[0-9]*' "$tmp/stopped/state.bin" 2>/dev/null | head -1 | cut -d: -f2)
[ "$rc" -eq 143 ] && [ -n "$at" ] && [ "$at" -lt 600 ] && grep -q "stopped by signal 15 .* after step $at of 600; its state is saved" "$tmp/stopped.err" ||
  fail "SIGTERM with --save: exit $rc, state at step '$at', $(tail -1 "$tmp/stopped.err")"
"$remat" train --resume "$tmp/stopped" --threads 1/1 > "$tmp/stopped.out" 2>&1 || fail "resuming the stopped run: $(tail -1 "$tmp/stopped.out")"
[ "$(sed -n 's/.*weights digest: //p' "$tmp/stopped.out")" = "$want" ] || fail "the stopped run resumed to other weights"

# A writer killed mid-save leaves its temporary file; the next start removes it.
touch "$tmp/run/state.bin.tmp.999999"

# Resumed with every flag left out, the run is the saved one: its banner shows the saved shape (not
# the flags' defaults) and the step it continues from, and it ends at the same weights.
cp -r "$tmp/run" "$tmp/copy"
"$remat" train --resume "$tmp/copy" --threads 1/1 > "$tmp/bare.out" 2> "$tmp/bare.err" || fail "bare resume: $(cat "$tmp/bare.err")"
head -1 "$tmp/bare.out" | grep -q "L=2 C=32 H=4 B=4 T=32 .* 600 steps" || fail "bare resume banner: $(head -1 "$tmp/bare.out")"
grep -q "resuming the run saved in $tmp/copy at step $((step + 1))" "$tmp/bare.out" || fail "no resume line: $(head -3 "$tmp/bare.out")"
[ "$(sed -n 's/.*weights digest: //p' "$tmp/bare.out")" = "$want" ] || fail "bare resume ended at other weights"
grep -q "train state: $tmp/copy/state.bin" "$tmp/bare.out" && grep -aq '"step":600' "$tmp/copy/state.bin" ||
  fail "a bare resume did not go on saving into the folder it resumed: $(grep -a -o '"step":[0-9]*' "$tmp/copy/state.bin" | head -1)"

"$remat" train "${args[@]}" --save "$tmp/run" --save-every 10 --resume "$tmp/run" --csv "$tmp/resumed.csv" \
  > "$tmp/resumed.out" 2> "$tmp/resumed.err" || fail "resume: $(cat "$tmp/resumed.err")"
# The resumed run's CSV is the whole run's: a header and steps 1 to 600.
[ "$(sed -n 2p "$tmp/resumed.csv" | cut -d, -f1)" = 1 ] && [ "$(tail -1 "$tmp/resumed.csv" | cut -d, -f1)" = 600 ] &&
  [ "$(wc -l < "$tmp/resumed.csv")" -eq 601 ] || fail "the resumed run's CSV: $(sed -n 2p "$tmp/resumed.csv") ... $(tail -1 "$tmp/resumed.csv")"
got=$(sed -n 's/.*weights digest: //p' "$tmp/resumed.out")
[ "$got" = "$want" ] || fail "killed at step $step and resumed: weights digest $got, uninterrupted $want"
[ ! -e "$tmp/run/state.bin.tmp.999999" ] || fail "a stale temporary file in the run folder was left there"

# The GEMM is part of the run: trained on the BLAS's GEMM, a resume without --gemm continues on it
# (not on whatever --gemm auto picks now) and ends at the uninterrupted run's weights. The GEMM is
# saved as its per-class record (remat::gemm_record).
blas=(--layers 2 --dim 32 --heads 4 --batch 4 --seq 32 --steps 200 --eval-every 0 --data "$tmp/text.txt" --threads 1/1)
"$remat" train "${blas[@]}" --gemm blas > "$tmp/blas.out" 2> "$tmp/blas.err" || fail "blas run: $(cat "$tmp/blas.err")"
"$remat" train "${blas[@]}" --gemm blas --save "$tmp/blasrun" --save-every 10 > /dev/null 2>&1 &
pid=$!
for _ in $(seq 1 1000); do [ -f "$tmp/blasrun/state.bin" ] && break; sleep 0.01; done
kill -9 "$pid" 2>/dev/null
wait "$pid" 2>/dev/null
"$remat" train --resume "$tmp/blasrun" --gemm onednn --threads 1/1 > /dev/null 2> "$tmp/gemm.err"
rc=$?
[ $rc -eq 2 ] && grep -q 'differs from the run saved in .* ("linear=blas-threads,blas-threads,blas-threads;head=blas,blas,blas")' "$tmp/gemm.err" ||
  fail "a resume with another --gemm: exit $rc, $(cat "$tmp/gemm.err")"
# --gemm auto (the default, here given) takes the saved choice over instead of measuring one.
"$remat" train --resume "$tmp/blasrun" --gemm auto --threads 1/1 > "$tmp/blasresumed.out" 2> "$tmp/blasresumed.err" ||
  fail "resuming the blas run: $(cat "$tmp/blasresumed.err")"
resumed=$(sed -n 's/.*weights digest: //p' "$tmp/blasresumed.out")
[ -n "$resumed" ] && [ "$resumed" = "$(sed -n 's/.*weights digest: //p' "$tmp/blas.out")" ] ||
  fail "the blas run resumed without --gemm ended at other weights ('$resumed')"

# One writer per run folder: a second training saving into the folder of a running one is refused.
"$remat" train "${args[@]}" --steps 100000 --save "$tmp/locked" > /dev/null 2>&1 &
first=$!
# until the first holds the folder's lock (flock(1) fails to take it), at most a minute. The folder
# is opened here, never created: flock(1) given a path creates a file there when the folder is
# missing (the first run's checks create and remove it before it takes the lock).
held() {
  local held=1
  exec 9< "$tmp/locked" 2> /dev/null || return 1
  flock -n 9 && held=0
  exec 9<&-
  [ $held -eq 1 ]
}
for _ in $(seq 1 6000); do [ -d "$tmp/locked" ] && held && break; sleep 0.01; done
"$remat" train "${args[@]}" --save "$tmp/locked" > /dev/null 2> "$tmp/lock.err"
rc=$?
kill -9 "$first" 2>/dev/null
wait "$first" 2>/dev/null
[ $rc -eq 2 ] && grep -q "another remat train is saving into" "$tmp/lock.err" || fail "a second writer: exit $rc, $(cat "$tmp/lock.err")"

# A damaged state is refused with one line and exit code 2.
printf 'garbage' | dd of="$tmp/run/state.bin" bs=1 seek=200 conv=notrunc 2>/dev/null
"$remat" train "${args[@]}" --resume "$tmp/run" > /dev/null 2> "$tmp/corrupt.err"
rc=$?
[ $rc -eq 2 ] && grep -q "is corrupt or truncated" "$tmp/corrupt.err" || fail "corrupt state: exit $rc, $(cat "$tmp/corrupt.err")"

echo "killed at step $step, resumed: weights digest $got equals the uninterrupted run's"
