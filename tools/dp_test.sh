#!/usr/bin/env bash
# Data-parallel training end to end, on c10d Gloo between local processes (one thread each):
#   - 2 ranks of batch b train bitwise like one process with --accum 2 of batch b;
#   - under data parallelism the policy changes nothing (none, attn, full, uniform:2, a budget), nor
#     does ZeRO-1;
#   - 3 and 4 ranks match one process with --accum 3 and 4 within a stated tolerance;
#   - every rank's peak memory is predicted to the byte, with and without ZeRO-1;
#   - kill -9 of a rank stops the run within seconds with one line naming it, keeps the last saved
#     state, and resuming every rank reaches the uninterrupted run's weights;
#   - SIGTERM to the launcher (Ctrl-C's SIGINT goes the same way), or to one rank from outside,
#     stops every rank after the same step with the state saved there, and resuming reaches the
#     uninterrupted run's weights;
#   - a different world size on resume is refused, and so are ranks started by hand (as on several
#     hosts) whose flags differ.
# Usage: dp_test.sh path/to/remat
set -u
remat=$(realpath "$1")
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
fail() { echo "FAIL: $*"; exit 1; }
for i in $(seq 1 3000); do echo "line $i: the fox and the dog met $((i * 7 % 13)) times by the river."; done > "$tmp/text.txt"
model=(--layers 2 --dim 32 --heads 4 --batch 4 --seq 32 --dropout 0.1)
args=("${model[@]}" --eval-every 0 --data "$tmp/text.txt")

run() {  # run NAME ARGS...: train, keep stdout in $tmp/NAME.out
  local name=$1
  shift
  "$remat" train "${args[@]}" "$@" > "$tmp/$name.out" 2> "$tmp/$name.err" || fail "$name: $(grep -v '^step' "$tmp/$name.err")"
}
digest() { sed -n 's/.*weights digest: //p' "$tmp/$1.out"; }
val() { sed -n 's/.*final validation loss \([0-9.]*\).*/\1/p' "$tmp/$1.out"; }

run accum2 --steps 30 --accum 2 --threads 1/1
run dp2 --steps 30 --nproc 2
[ -n "$(digest accum2)" ] && [ "$(digest dp2)" = "$(digest accum2)" ] ||
  fail "2 ranks: weights $(digest dp2), one process with --accum 2: $(digest accum2)"
[ -n "$(val accum2)" ] && [ "$(val dp2)" = "$(val accum2)" ] || fail "2 ranks: validation loss $(val dp2), --accum 2: $(val accum2)"

for p in attn full uniform:2 budget:80%; do
  run "dp2_$p" --steps 30 --nproc 2 --policy "$p"
  [ "$(digest "dp2_$p")" = "$(digest dp2)" ] || fail "2 ranks under $p: weights $(digest "dp2_$p"), under none $(digest dp2)"
done
run zero1 --steps 30 --nproc 2 --zero 1 --bucket-mb 0.05
[ "$(digest zero1)" = "$(digest dp2)" ] || fail "ZeRO-1 (small buckets): weights $(digest zero1), ZeRO-0 $(digest dp2)"
grep -q "rank 1: peak .*equal" "$tmp/zero1.out" || fail "ZeRO-1 peak not predicted: $(grep rank "$tmp/zero1.out")"
for f in dp2 zero1 dp2_uniform:2; do
  [ "$(grep -c 'rank [0-9]: peak .*, equal)' "$tmp/$f.out")" -eq 2 ] || fail "$f: a rank's peak differs from its prediction: $(grep 'rank ' "$tmp/$f.out")"
done

# remat plan --device cpu --dp 2 predicts the most-loaded rank's peak that training measured.
for z in 0 1; do
  f=$([ $z -eq 0 ] && echo dp2 || echo zero1)
  measured=$(sed -n 's/^ *rank [0-9]: peak .* = \([0-9]*\) B .*/\1/p' "$tmp/$f.out" | sort -n | tail -1)
  planned=$("$remat" plan --device cpu --dp 2 --zero $z "${model[@]}" | sed -n 's/^  peak: .* = \([0-9]*\) B, .*/\1/p')
  [ -n "$measured" ] && [ "$planned" = "$measured" ] || fail "ZeRO-$z: remat plan --dp 2 says $planned B, training measured $measured B"
done
measured=$(sed -n 's/^ *rank [0-9]: peak .* = \([0-9]*\) B .*/\1/p' "$tmp/dp2_uniform:2.out" | sort -n | tail -1)
planned=$("$remat" plan --device cpu --dp 2 --zero 0 --policies uniform:2 "${model[@]}" | sed -n 's/^  peak: .* = \([0-9]*\) B, .*/\1/p')
[ -n "$measured" ] && [ "$planned" = "$measured" ] || fail "uniform:2: remat plan --dp 2 says $planned B, training measured $measured B"


# 3 and 4 ranks sum in another order than one process does: equal within 1e-4 of the loss.
for n in 3 4; do
  run "accum$n" --steps 20 --accum "$n" --threads 1/1
  run "dp$n" --steps 20 --nproc "$n"
  [ -n "$(val "dp$n")" ] && [ -n "$(val "accum$n")" ] || fail "$n ranks: no validation loss in the output to compare"
  awk -v a="$(val "dp$n")" -v b="$(val "accum$n")" 'BEGIN { d = a - b; if (d < 0) d = -d; exit !(d <= 1e-4 * b) }' ||
    fail "$n ranks: validation loss $(val "dp$n"), one process with --accum $n: $(val "accum$n")"
done

# kill -9 of rank 1 mid-run: the launcher names it and stops within seconds; resume all ranks. The
# run is ZeRO-1's (its saves gather the moments' shares on rank 0), whose weights are ZeRO-0's.
run straight --steps 300 --nproc 2
"$remat" train "${args[@]}" --steps 300 --nproc 2 --zero 1 --save "$tmp/run" --save-every 10 > /dev/null 2> "$tmp/kill.err" &
launcher=$!
for _ in $(seq 1 1000); do [ -f "$tmp/run/state.bin" ] && break; sleep 0.01; done
victim=$(pgrep -P "$launcher" | sort -n | tail -1)
[ -n "$victim" ] || fail "no rank to kill"
start=$(date +%s%N)
kill -9 "$victim"
wait "$launcher"
rc=$?
took=$(( ($(date +%s%N) - start) / 1000000 ))
[ "$rc" -ne 0 ] || fail "the launcher exited 0 after a rank was killed"
[ "$took" -lt 10000 ] || fail "the launcher took $took ms to stop after a rank was killed"
grep -q "remat: error: rank [01] (pid $victim) was killed by signal 9" "$tmp/kill.err" || fail "no line naming the lost rank: $(cat "$tmp/kill.err")"
[ "$(grep -c '^remat: error:' "$tmp/kill.err")" -eq 1 ] || fail "the lost rank was reported in more than one line: $(cat "$tmp/kill.err")"
step=$(grep -a -o '"step":[0-9]*' "$tmp/run/state.bin" | head -1 | cut -d: -f2)
[ -n "$step" ] && [ "$step" -lt 300 ] || fail "the run finished (step $step) before kill -9"
run resumed --steps 300 --nproc 2 --zero 1 --save "$tmp/run" --save-every 10 --resume "$tmp/run"
[ "$(digest resumed)" = "$(digest straight)" ] || fail "killed at step $step and resumed: $(digest resumed), uninterrupted $(digest straight)"

# SIGTERM to the launcher (a scheduler, kill) or to one rank from outside: every rank finishes the
# step under way and the state is saved there; the launcher exits 143 with the leader's line.
stops=""
for target in launcher rank; do
  rm -rf "$tmp/stop"
  "$remat" train "${args[@]}" --steps 300 --nproc 2 --save "$tmp/stop" --save-every 10 > /dev/null 2> "$tmp/stop.err" &
  launcher=$!
  for _ in $(seq 1 1000); do [ -f "$tmp/stop/state.bin" ] && break; sleep 0.01; done
  victim=$launcher
  [ "$target" = rank ] && victim=$(pgrep -P "$launcher" | sort -n | tail -1)
  [ -n "$victim" ] || fail "no rank to stop"
  kill -TERM "$victim"
  wait "$launcher"
  rc=$?
  said=$(grep -v '^step' "$tmp/stop.err")
  [ "$rc" -eq 143 ] || fail "SIGTERM to the $target: the launcher exited $rc: $said"
  at=$(sed -n 's/^remat: stopped by signal 15 (Terminated) after step \([0-9]*\) of 300; its state is saved.*/\1/p' "$tmp/stop.err")
  [ -n "$at" ] && ! grep -q '^remat: error:' "$tmp/stop.err" || fail "SIGTERM to the $target: $said"
  saved_at=$(grep -a -o '"step":[0-9]*' "$tmp/stop/state.bin" | head -1 | cut -d: -f2)
  [ "$saved_at" = "$at" ] && [ "$saved_at" -lt 300 ] ||
    fail "SIGTERM to the $target: stopped after step $at, state saved at $saved_at"
  run "stopped_$target" --steps 300 --nproc 2 --save "$tmp/stop" --save-every 10 --resume "$tmp/stop"
  [ "$(digest "stopped_$target")" = "$(digest straight)" ] ||
    fail "SIGTERM to the $target at step $saved_at, resumed: $(digest "stopped_$target"), uninterrupted $(digest straight)"
  stops="$stops, SIGTERM to the $target at step $saved_at"
done

# kill -9 of the launcher: its ranks die with it (a parent-death signal); none is left training.
"$remat" train "${args[@]}" --steps 3000 --nproc 2 > /dev/null 2>&1 &
launcher=$!
for _ in $(seq 1 500); do [ "$(pgrep -P "$launcher" | wc -l)" -eq 2 ] && break; sleep 0.01; done
ranks=$(pgrep -P "$launcher")
[ -n "$ranks" ] || fail "the launcher started no ranks"
sleep 1
kill -9 "$launcher"
wait "$launcher" 2>/dev/null
alive=1
for _ in $(seq 1 500); do
  alive=0
  for r in $ranks; do kill -0 "$r" 2>/dev/null && alive=1; done
  [ "$alive" -eq 0 ] && break
  sleep 0.01
done
[ "$alive" -eq 0 ] || fail "ranks $(echo $ranks) outlived their launcher (kill -9)"

# Ranks started by hand (as on several hosts) with the same flags train; with another --lr on one,
# all refuse before a step.
port=$((20000 + RANDOM % 20000))
"$remat" train "${args[@]}" --steps 5 --threads 1/1 --rank 0 --world-size 2 --master "127.0.0.1:$port" \
  > "$tmp/hand0.out" 2> "$tmp/hand0.err" &
first=$!
"$remat" train "${args[@]}" --steps 5 --threads 1/1 --rank 1 --world-size 2 --master "127.0.0.1:$port" \
  > /dev/null 2> "$tmp/hand1.err" || fail "rank 1 started by hand: $(cat "$tmp/hand1.err")"
wait "$first" || fail "rank 0 started by hand: $(cat "$tmp/hand0.err")"
grep -q "weights digest" "$tmp/hand0.out" || fail "rank 0 started by hand printed no digest"
port=$((20000 + RANDOM % 20000))
"$remat" train "${args[@]}" --steps 5 --threads 1/1 --rank 0 --world-size 2 --master "127.0.0.1:$port" \
  > /dev/null 2> "$tmp/agree0.err" &
first=$!
"$remat" train "${args[@]}" --steps 5 --threads 1/1 --rank 1 --world-size 2 --master "127.0.0.1:$port" --lr 0.002 \
  > /dev/null 2> "$tmp/agree1.err"
rc1=$?
wait "$first"
rc0=$?
for r in 0 1; do
  grep -q "1 of the 2 ranks start from other flags, data or saved state than rank 0" "$tmp/agree$r.err" ||
    fail "rank $r with another --lr than its peer: $(cat "$tmp/agree$r.err")"
done
[ "$rc0" -eq 2 ] && [ "$rc1" -eq 2 ] || fail "ranks that differ exited $rc0 and $rc1, not 2"

"$remat" train "${args[@]}" --steps 300 --resume "$tmp/run" > /dev/null 2> "$tmp/world.err"
rc=$?
[ $rc -eq 2 ] && grep -q "was trained on 2 process(es); resume it with --nproc 2" "$tmp/world.err" ||
  fail "a resume on another world size: exit $rc, $(cat "$tmp/world.err")"

echo "data parallel: 2 ranks = --accum 2 bitwise; policy and ZeRO-1 change nothing; peaks predicted; killed at step $step in $took ms$stops, each resumed to $(digest resumed)"
