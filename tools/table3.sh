#!/usr/bin/env bash
# Korthikanti et al. 2022, Table 3's four models (t = 8; p = 1, 8, 35, 64; s = 2048; micro-batch 1;
# no data parallelism), planned by remat: per-GPU activations of the most-loaded stage (the first
# holds p micro-batches in flight) and its total with bf16 weights, fp32 gradients and Adam, under
# the paper's four settings, attention scores stored dense as the paper counts them. Beside each,
# the paper's formula (Table 2 per layer, times L: the first stage holds p micro-batches of L/p
# layers). Prints a markdown table. Usage: table3.sh path/to/remat
set -eu
remat=$1

cell() {  # cell MODEL PP POLICY SP-FLAG: "activations / total" of the most-loaded stage
  local flags=(--model "$1" --tp 8 --pp "$2" --dp 1 --vpp 1 --micro-batch 1 --policies "$3" "$4" --attention math --attn-block 2048)
  local out row
  # The breakdown on an A100's compute with memory to spare, so that every setting prints one;
  # bold when the same layout fits an 80 GB A100 (remat plan's budget and margin).
  out=$("$remat" plan "${flags[@]}" --device custom:1000GiB,312,2039)
  row=$(grep -E '^\| (stage [0-9]+ \(most\)|every GPU) ' <<<"$out" | head -1)
  local act total
  act=$(awk -F'|' '{ gsub(/^ +| +$/, "", $6); print $6 }' <<<"$row")
  total=$(awk -F'|' '{ gsub(/^ +| +$/, "", $8); print $8 }' <<<"$row")
  local fits="$total"
  "$remat" plan "${flags[@]}" --device a100-80gb > /dev/null 2>&1 && fits="**$total**"
  echo "$act ($(formula "$@")) / $fits"
}

formula() {  # formula MODEL PP POLICY SP-FLAG: Table 2's bytes per layer x L, in GiB
  local L h a
  case $1 in
    megatron-22b) L=48 h=6144 a=64 ;;
    megatron-175b) L=96 h=12288 a=96 ;;
    megatron-530b) L=105 h=20480 a=128 ;;
    megatron-1t) L=128 h=25600 a=160 ;;
  esac
  awk -v L=$L -v h=$h -v a=$a -v p="$3" -v sp="$4" 'BEGIN {
    s = 2048; b = 1; t = 8; x = s * b * h
    if (p == "none") f = x * (10 + 24 / t + 5 * a * s / (h * t))
    else if (p == "attn" && sp == "--no-sp") f = x * (10 + 24 / t)
    else if (p == "attn") f = 34 * x / t
    else f = 2 * x / t
    printf "%.2f", L * f / 2^30 }'
}

echo "| model | t | p | no recompute (TP) | selective (TP) | TP + SP + selective | full (TP + SP) |"
echo "|:--|--:|--:|--:|--:|--:|--:|"
for row in "megatron-22b 1" "megatron-175b 8" "megatron-530b 35" "megatron-1t 64"; do
  set -- $row
  echo "| $1 | 8 | $2 | $(cell "$1" "$2" none --no-sp) | $(cell "$1" "$2" attn --no-sp) | $(cell "$1" "$2" attn --sp) | $(cell "$1" "$2" full --sp) |"
done
