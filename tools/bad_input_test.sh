#!/usr/bin/env bash
# Bad input, one row per case. Every row must: exit with code 2; write exactly one line
# on stderr, "remat: error: ...", containing the row's text (the bad value and what is allowed);
# print nothing on stdout (the refusal comes before any work, a header included); finish within a
# minute (no hang); and leave the sandbox exactly as it was: no file created, changed or replaced,
# devices and FIFOs included. Usage: bad_input_test.sh path/to/remat
set -u
remat=$(realpath "$1")
box=$(mktemp -d) scratch=$(mktemp -d)
trap 'rm -rf "$box" "$scratch"' EXIT
failures=0
cases=0

# ---- the sandbox: files a user already has, which bad input must not touch ------------------------
echo '{"kept": true}' > "$box/keep.json"
echo 'kept,1' > "$box/keep.csv"
for i in $(seq 1 2000); do echo "line $i: the fox and the dog met $((i * 7 % 13)) times by the river."; done > "$box/text.txt"
printf 'tiny' > "$box/tiny.txt"
mkdir "$box/folder" "$box/fifo_run" "$box/garbage" "$box/truncated" "$box/earlier"
mkfifo "$box/fifo" "$box/fifo_run/state.bin"
shape=(--layers 1 --dim 16 --heads 2 --batch 2 --seq 16)
"$remat" train "${shape[@]}" --steps 2 --eval-every 0 --data "$box/text.txt" --threads 1/1 --gemm onednn --save "$box/run" \
  >/dev/null 2>"$box/setup.err" || { echo "FAIL: setting up a train state: $(cat "$box/setup.err")"; exit 1; }
rm "$box/setup.err"
printf 'REMATTS2 this is not a train state' > "$box/garbage/state.bin"
printf 'REMATTS1 an earlier release wrote this' > "$box/earlier/state.bin"
head -c 300 "$box/run/state.bin" > "$box/truncated/state.bin"
echo '{"architectures": ["LlamaForCausalLM"], "hidden_size": 64, "num_attention_heads": 4, "num_hidden_layers": 2,
  "intermediate_size": 128, "vocab_size": 100}' > "$box/llama.json"
echo '{"architectures": [5]}' > "$box/arch-number.json"
echo '{"name": 5}' > "$box/device-type.json"
echo '{"memory": "80GiB", "bf16_tflops": 900, "hbm_gbps": 3000}' > "$box/dev.json"
ln "$box/keep.csv" "$box/hard.csv"
echo '{' > "$box/device-syntax.json"
echo '{"memory": 1e30, "bf16_tflops": 900, "hbm_gbps": 3000}' > "$box/device-float.json"
echo '{"memory": "80GiB", "bf16_tflops": 900, "hbm_gbps": 3000, "gpus_per_node": 2.5}' > "$box/device-half.json"
echo '{"memory": "80GiB", "bf16_tflops": 900, "hbm_gbps": 3000, "link_efficiency": 1.5}' > "$box/device-eff.json"
echo '{"memory": "80GiB", "hbm_gbps": 3000}' > "$box/device-flops.json"
echo '{"memory": 0, "bf16_tflops": 900, "hbm_gbps": 3000}' > "$box/device-memory.json"
echo '{"memory": "80GiB", "bf16_tflops": 900, "hbm_gbps": 0}' > "$box/device-hbm.json"

# The sandbox as (type, path, inode; size and mtime but for folders, whose mtime a write check's
# temporary file moves) and the content of every regular file.
snapshot() {
  find "$box" -type d -printf '%y %p %i\n' -o -printf '%y %p %s %T@ %i\n' | sort
  find "$box" -type f -exec md5sum {} + | sort
}
before=$(snapshot)

tiny=(--layers 2 --dim 16 --heads 4 --batch 2 --seq 8 --steps 1 --warmup 0)
gpt3=(--model gpt3-175b --gpus 64 --device a100-80gb)

# bad TEXT ARGS...: one row.
bad() {
  local text=$1
  shift
  cases=$((cases + 1))
  # The caches (the GEMM choice, op costs, calibrations) are in the sandbox: a refusal that measured
  # any of them first leaves a file there.
  (cd "$box" && REMAT_CACHE="$box/cache" timeout 60 "$remat" "$@" >"$scratch/out" 2>"$scratch/err" </dev/null)
  local rc=$? why=""
  local out="$scratch/out" err="$scratch/err"
  if [ "$rc" -eq 124 ]; then why="hung (killed after 60 s)"
  elif [ "$rc" -ne 2 ]; then why="exit $rc, not 2"
  elif [ "$(grep -c . "$err")" -ne 1 ]; then why="$(grep -c . "$err") lines on stderr, not 1"
  elif ! grep -q '^remat: error: ' "$err"; then why="stderr is not 'remat: error: ...'"
  elif ! grep -qF -- "$text" "$err"; then why="stderr lacks '$text'"
  elif [ -s "$out" ]; then why="it printed before refusing: '$(head -1 "$out")'"
  fi
  local now
  now=$(snapshot)
  if [ -z "$why" ] && [ "$now" != "$before" ]; then
    why="the sandbox changed: $(diff <(echo "$before") <(echo "$now") | grep '^[<>]' | head -3 | tr '\n' ' ')"
    before=$now
  fi
  if [ -n "$why" ]; then
    echo "FAIL: remat $*: $why"
    sed 's/^/  stderr: /' "$err" | head -5
    failures=$((failures + 1))
  fi
  rm -f "$out" "$err"
}

# ---- flags and their values ---------------------------------------------------------------------
bad "The following argument was not expected: --bogus" bench --bogus
bad "A subcommand is required" --layers 2
# remat cpu runs no product: it takes no GEMM or BLAS kernel, and no argument.
bad "not expected: blas --gemm" cpu --gemm blas
bad "not expected: keep --blas-kernel" cpu --blas-kernel keep
bad "not expected: extra" cpu extra
# --remeasure is a flag of the commands that read cached measurements (bench, plan, train).
bad "not expected: --remeasure" cpu --remeasure
bad "not expected: --remeasure" sample --load /nonexistent --remeasure
bad "Could not convert: --remeasure = maybe" bench "${tiny[@]}" --remeasure=maybe
bad "--layers must be a positive integer, got 0" bench "${tiny[@]}" --layers 0
bad "--batch must be a positive integer, got -1" bench "${tiny[@]}" --batch -1
bad "--dim 16 is not divisible by --heads 3" bench "${tiny[@]}" --heads 3
bad "--heads 4 is not divisible by --kv-heads 3" bench "${tiny[@]}" --arch llama --kv-heads 3
bad "--ffn must be >= 0 (0 means 4 * dim), got -4" bench "${tiny[@]}" --ffn -4
bad "--vocab must be a positive integer, got 0" bench "${tiny[@]}" --arch gpt2 --vocab 0
bad "--vocab sizes a token model's embedding and LM head; the seed block" bench "${tiny[@]}" --vocab 1000
bad "--head-dim must be in 0..65536 (0: dim / heads), got -1" bench "${tiny[@]}" --head-dim -1
bad "--experts must be in 1..4096, got 0" bench "${tiny[@]}" --arch moe --experts 0
bad "--top-k must be in 1..experts (8), got 9" bench "${tiny[@]}" --arch moe --top-k 9
bad "--capacity-factor must be 0 (dropless) or in (0, 1024], got -1" bench "${tiny[@]}" --arch moe --capacity-factor -1
bad "unknown --router 'argmax'; allowed: softmax, sigmoid, sinkhorn" bench "${tiny[@]}" --arch moe --router argmax
bad "--aux-loss 0.01 with --router sinkhorn" bench "${tiny[@]}" --arch moe --router sinkhorn --top-k 1 --aux-loss 0.01
bad "unknown --expert-weights 'foo'; allowed: combine" bench "${tiny[@]}" --arch moe --expert-weights foo
bad "--shared-ffn must be in 0..16777216 (0: no shared expert), got -8" bench "${tiny[@]}" --arch moe --shared-ffn -8
bad "--aux-loss must be in [0, 1000], got -0.5" bench "${tiny[@]}" --arch moe --aux-loss -0.5
moe=(--arch moe --layers 2 --dim 64 --heads 4 --seq 16 --vocab 64 --device h100-80gb)
bad "--ep 3 must divide the experts (8)" plan "${moe[@]}" --global-batch 12 --gpus 6 --tp 1 --pp 1 --dp 6 --ep 3
bad "--ep 2 splits experts over ranks; a llama block has none" plan "${moe[@]}" --global-batch 8 --arch llama --gpus 2 --tp 1 --pp 1 --dp 2 --ep 2
bad "--etp 2 splits experts' linears over ranks; a llama block has none" plan "${moe[@]}" --global-batch 8 --arch llama --gpus 2 --tp 2 --pp 1 --dp 1 --etp 2
bad "--etp 4 must divide tp 2" plan "${moe[@]}" --global-batch 8 --gpus 8 --tp 2 --sp --pp 1 --dp 4 --etp 4
bad "--tp 2 without sp: a mixture of experts routes each rank's share" plan "${moe[@]}" --global-batch 8 --gpus 2 --tp 2 --no-sp --pp 1 --dp 1
bad "--etp must be in 1..1048576, got 0" plan "${moe[@]}" --global-batch 8 --gpus 2 --etp 0
bad "--framework torchtitan is torchtitan at 9dec370 (December 2024), which has no mixture of experts; plan --arch moe with --framework megatron" plan "${moe[@]}" --global-batch 8 --gpus 2 --framework torchtitan
bad "--etp 1 with FSDP is not modelled" plan "${moe[@]}" --global-batch 8 --gpus 4 --tp 2 --sp --dp 2 --pp 1 --fsdp --etp 1
bad "--fsdp with pp 2: FSDP2 under pipeline stages is not modelled" plan --arch llama --layers 4 --dim 256 --heads 4 --seq 256 --vocab 1024 --dtype bf16 --device h100-80gb --gpus 8 --framework torchtitan --pp 2 --global-batch 16
bad "unknown --router-dtype 'fp16'; allowed: model, fp32" plan "${moe[@]}" --global-batch 8 --gpus 2 --router-dtype fp16
bad "--expert-imbalance must be in [1, 1024]" plan "${moe[@]}" --global-batch 8 --gpus 2 --expert-imbalance 0.5
bad "model 'deepseek-v3' is not modelled: its multi-head latent attention" plan --model deepseek-v3 --gpus 256 --device h100-80gb
bad "preset 'attn' in 'attn' drops nothing in a llama block: it has no T x T attention tensor" plan --arch llama --layers 2 --dim 256 --heads 4 --seq 256 --vocab 1024 --dtype bf16 --global-batch 8 --gpus 8 --device h100-80gb --policies attn
bad "--fsdp-root 'drop': allowed are reshard (PyTorch 2.8 and later) and keep" plan --model llama2-70b --gpus 16 --device h100-80gb --framework torchtitan --fsdp-root drop
bad "--no-fused-wgrad describes Megatron-LM; --framework torchtitan has no such setting" plan --model llama2-70b --gpus 16 --device h100-80gb --framework torchtitan --no-fused-wgrad
bad "--no-sp: torchtitan's tensor parallelism is always sequence-parallel" plan --model llama2-70b --gpus 16 --device h100-80gb --framework torchtitan --no-sp
bad "no layout of these flags validates (tp 3 does not divide the 32 heads)" plan --model llama2-7b --gpus 6 --device h100-80gb --tp 3
bad "no layout of these flags validates (pp 40 is more than the 32 layers)" plan --model llama2-7b --gpus 40 --device h100-80gb --pp 40
bad "expert rows of 33554432 features, over 2^60 bytes" plan --device h100-80gb --gpus 1 --micro-batch 8 --global-batch 8 --dtype bf16 --arch moe --layers 1 --experts 4096 --top-k 4096 --seq 16777216 --dim 8 --heads 1 --ffn 16777216 --policies none
bad "--head-dim 7 is odd; rotary embeddings turn pairs of head dimensions" plan --device h100-80gb --gpus 1 --arch llama --dim 64 --heads 4 --head-dim 7 --global-batch 8
bad "--no-grouped-gemm: --arch llama has no experts" plan --model llama2-70b --gpus 16 --device h100-80gb --no-grouped-gemm
bad "--deterministic changes only a mixture of experts' unpermute here; --arch llama has none" plan --model llama2-70b --gpus 16 --device h100-80gb --deterministic
bad "--pure-bf16 keeps weights, gradients and Adam state in bf16; give --dtype bf16" plan --model llama2-7b --gpus 8 --device h100-80gb --dtype fp32 --pure-bf16
bad "--grad-dtype fp32 with --pure-bf16, which keeps every gradient in bf16" plan --model llama2-7b --gpus 8 --device h100-80gb --pure-bf16 --grad-dtype fp32
bad "--grad-dtype sets Megatron-LM's gradient buffers; FSDP2" plan --model llama2-7b --gpus 8 --device h100-80gb --framework torchtitan --grad-dtype bf16
bad "--expert-imbalance sizes dropless routing's busiest rank; --capacity-factor 1 fixes" plan "${moe[@]}" --global-batch 8 --gpus 2 --capacity-factor 1 --expert-imbalance 2
bad "--expert-imbalance sizes the busiest expert-parallel rank; --ep 1 keeps every expert" plan "${moe[@]}" --global-batch 8 --gpus 2 --ep 1 --expert-imbalance 2
bad "--dispatcher 'flex': allowed are allgather (Megatron-LM's default) and alltoall" plan --model mixtral-8x7b --gpus 64 --device h100-80gb --global-batch 256 --dispatcher flex
bad "policy 'uniform:1' runs uniform:N segments, which are planned on layouts of one pipeline stage" plan --model llama2-70b --gpus 16 --device h100-80gb --tp 8 --pp 2 --dp 1 --policies uniform:1
bad "--attn-block must be a positive integer, got 0" bench "${tiny[@]}" --attn-block 0
bad "--dropout must be in [0, 1), got 1.5" bench "${tiny[@]}" --arch gpt2 --dropout 1.5
bad "--dropout must be in [0, 1), got nan" bench "${tiny[@]}" --arch gpt2 --dropout nan
bad "unknown --arch 'gpt5'; allowed: seed, gpt2" bench "${tiny[@]}" --arch gpt5
bad "unknown --engine 'gpu'; allowed: module, ops" bench "${tiny[@]}" --engine gpu
bad "unknown --attention 'sdpa'" bench "${tiny[@]}" --attention sdpa
bad "--attention takes one of math, flash here, got 'math,flash'" train --attention math,flash
bad "--steps must be in 1..10000, got 0" bench "${tiny[@]}" --steps 0
bad "--warmup must be in 0..10000, got -1" bench "${tiny[@]}" --warmup -1
bad "--threads 'x'" bench "${tiny[@]}" --threads x
bad "--threads '0/1': expected N or A/B with positive integers" bench "${tiny[@]}" --threads 0/1
bad "--threads '999/1': at most" bench "${tiny[@]}" --threads 999/1
bad "recomputes only some tensors" bench "${tiny[@]}" --policies attn --engine module
bad "--json was given an empty value" bench "${tiny[@]}" --json ''
bad "--policies was given an empty value" bench "${tiny[@]}" --policies ''
bad "unknown --blas-kernel 'Pentium'; allowed: auto, keep, Prescott" bench "${tiny[@]}" --blas-kernel Pentium
bad "unknown --blas-kernel 'fast'; allowed: auto, keep" train --blas-kernel=fast
bad "unknown --blas-kernel 'Pentium'; allowed: auto, keep" plan --budget 50% --blas-kernel Pentium
bad "--gemm 'mkl' is unknown; allowed: auto, onednn, blas" bench "${tiny[@]}" --gemm mkl
bad "--gemm 'OneDNN' is unknown; allowed: auto, onednn, blas" train --gemm OneDNN
bad "--gemm was given an empty value" plan --budget 50% --gemm ''
bad "--gemm 'linear=blas-threads,blas,blas;head=blas-threads,blas,blas': blas-threads runs linears only, not head q k^T" \
  bench "${tiny[@]}" --gemm 'linear=blas-threads,blas,blas;head=blas-threads,blas,blas'
bad "--gemm 'linear=blas,blas;head=blas,blas,blas' names 2 GEMMs for the linears; give three" bench "${tiny[@]}" --gemm 'linear=blas,blas;head=blas,blas,blas'
bad "--experts is for a mixture of experts (--arch moe); a gpt2 block has no experts" bench "${tiny[@]}" --arch gpt2 --experts 16
bad "--router is for a mixture of experts (--arch moe); a llama block has no experts" plan --model-config llama.json --budget 1GB --router sigmoid
bad "the seed block takes no decoder choice (those are for gpt2 and llama); this model sets --norm, --qkv" bench "${tiny[@]}" --arch seed --qkv fused --norm rms
bad "--engine lists 'ops' twice" bench "${tiny[@]}" --engine ops,ops
bad "--engine 'ops,' has an empty item" bench "${tiny[@]}" --engine ops,
bad "--attention lists 'math' twice" bench "${tiny[@]}" --arch gpt2 --attention math,math
bad "attention flash is for causal blocks (gpt2, llama, moe); a seed block attends to all positions" bench "${tiny[@]}" --attention flash
bad "--nproc 4 starts its own ranks, and --rank makes this process one rank" train --rank 0 --world-size 2 --master 127.0.0.1:29500 --nproc 4
bad "--rank 5 must be in 0..1 for --world-size 2" train --rank 5 --world-size 2 --master 127.0.0.1:29500
bad "--master '127.0.0.1: 29500': the port must be in 1..65535" train --rank 0 --world-size 2 --master '127.0.0.1: 29500'
# ---- integers: decimal only (CLI11 alone reads 0x10 as 16 and clamps what overflows) -------------
bad "--layers: '0x10' is not a decimal integer" bench "${tiny[@]}" --layers 0x10
bad "--layers: ' 4' is not a decimal integer" bench "${tiny[@]}" --layers ' 4'
bad "--seed: '99999999999999999999999' is out of range (0..18446744073709551615)" bench "${tiny[@]}" --seed 99999999999999999999999
# a flag held in 32 bits names its own range
bad "--steps: '99999999999' is out of range (-2147483648..2147483647)" bench "${tiny[@]}" --steps 99999999999
bad "--top: '2147483648' is out of range (-2147483648..2147483647)" plan --top 2147483648 --gpus 8 --device h100
bad "--dist-timeout: '-2147483649' is out of range (-2147483648..2147483647)" train --dist-timeout -2147483649
# ---- sizes: limits that say why, overflow-safe products, out-of-range integers --------------------
bad "--dim 99999999999 is over the limit 1048576" plan --dim 99999999999 --heads 1 --budget 1GB
bad "--seq 3000000000 is over the limit 16777216" plan --seq 3000000000 --budget 1GB
bad "--layers 100000000 is over the limit 16384" plan --layers 100000000 --budget 1GB
bad "makes tensors of" plan --batch 16000000 --seq 16000000 --budget 1GB
bad "makes tensors of" plan --heads 65536 --head-dim 65536 --dim 64 --batch 16000000 --seq 16 --budget 1GB
bad "--seq: '99999999999999999999' is out of range (-9223372036854775808..9223372036854775807)" plan --seq 99999999999999999999 --budget 1GB
bad "--layers: '-99999999999999999999' is out of range" bench --layers -99999999999999999999
bad "with math attention, none (every bench's reference step) is predicted to peak at" \
  bench --arch gpt2 --seq 65536 --batch 8 --policies none --steps 1 --warmup 0
bad "with math attention, none (every bench's reference step) beside the other 7 runs' weights, moments and gradients" \
  bench --arch gpt2 --layers 48 --dim 4096 --heads 32 --batch 1 --seq 128 --policies none,attn,mlp-act,attn+mlp-act,norm,full,every:2,every:3 --steps 1 --warmup 0 --engine ops
bad "needs about" train --policy uniform:2 --batch 100000 --seq 1024 --data "$box/text.txt"
bad "needs about" train --policy none --batch 100000 --seq 1024 --data "$box/text.txt"
# --nproc: the launcher refuses them before it measures the GEMM choice for its ranks.
bad "on each of 2 process(es)" train --nproc 2 --policy uniform:2 --batch 100000 --seq 1024 --data "$box/text.txt"
# ---- policies and budgets -----------------------------------------------------------------------
bad "unknown policy term 'atn'" bench "${tiny[@]}" --policies none,atn
bad "empty policy in the list 'none,,full'" bench "${tiny[@]}" --policies none,,full
bad "every:K needs a positive integer, got '0'" bench "${tiny[@]}" --policies every:0
bad "every:K needs a positive integer, got '99999999999999999999'" bench "${tiny[@]}" --policies every:99999999999999999999
bad "exceeds the model's 2 layers (0-1)" bench "${tiny[@]}" --policies layers:5-9=full
bad "unknown tensor 'nope' in 'save:nope'" bench "${tiny[@]}" --policies save:nope
bad "unknown tensor 'nope' in 'save:nope'" bench "${tiny[@]}" --arch gpt2 --attention math,flash --policies save:nope
bad "block:9 exceeds the model's 2 layers" bench "${tiny[@]}" --policies none,block:9
bad "preset 'attn' in 'attn' drops nothing in a gpt2 block" bench "${tiny[@]}" --arch gpt2 --attention flash --policies attn
bad "bad budget '0'" bench "${tiny[@]}" --policies budget:0
bad "bad budget '-5%'" bench "${tiny[@]}" --policies budget:-5%
bad "budget '99999999999999999999999GB' is too large" bench "${tiny[@]}" --policies budget:99999999999999999999999GB
bad "budget 1000 B cannot be met" bench "${tiny[@]}" --policies none,budget:1KB
bad "unknown policy term 'atn'" train --policy atn
bad "budget 1KB (1000 B) cannot be met" plan --layers 2 --dim 16 --heads 4 --seq 8 --batch 2 --budget 1KB --costs measured
bad "--budget is required" plan --layers 2 --dim 16 --heads 4 --seq 8 --batch 2
bad "bad budget unit 'XB' in '12XB'" plan --layers 2 --dim 16 --heads 4 --seq 8 --batch 2 --budget 12XB
bad "cannot be met: the smallest peak any policy reaches is" plan --model gpt3-175b --budget 80GB
bad "unknown tensor 'ln9'" plan --layers 2 --dim 16 --heads 4 --seq 8 --batch 2 --budget 1GB --pins keep:ln9
bad "unknown cost source 'magic'; allowed: auto, measured, estimated" plan --budget 1GB --costs magic
bad "unknown --dtype 'fp8'; allowed: fp32, bf16, fp16" plan --budget 1GB --dtype fp8
bad "unknown model 'gpt5'; the presets are: gpt2-small" plan --model gpt5 --budget 1GB
# ---- multi-GPU layouts --------------------------------------------------------------------------
bad "--device 'tpu9' is neither a preset (h100-80gb" plan --model gpt3-175b --gpus 64 --device tpu9
bad "--device file 'device-type.json': a field has the wrong type" plan --model gpt3-175b --gpus 64 --device device-type.json
bad "--device file 'device-float.json': \"memory\" must be a whole number, got 1e+30" plan --model gpt3-175b --gpus 64 --device device-float.json
bad "--device file 'device-half.json': \"gpus_per_node\" must be a whole number, got 2.5" plan --model gpt3-175b --gpus 64 --device device-half.json
bad "GPUS_PER_NODE must be a whole number in 1..1048576, got '1e30'" plan --model gpt3-175b --gpus 64 --device custom:80GiB,900,3000,400,50,1e30
bad "GPUS_PER_NODE must be a whole number in 1..1048576, got '2.5'" plan --model gpt3-175b --gpus 64 --device custom:80GiB,900,3000,400,50,2.5
bad "bf16_tflops must be at most 1e+06 (a thousand times any GPU's), got 1e+308" plan --model gpt3-175b --gpus 64 --device custom:80GiB,1e308,3000
bad "--device file 'device-syntax.json' is not JSON" plan --model gpt3-175b --gpus 64 --device device-syntax.json
bad "link_efficiency must be in (0, 1], got 1.5" plan --model gpt3-175b --gpus 64 --device device-eff.json
bad "give bf16_tflops or fp32_tflops > 0, got 0 and 0" plan --model gpt3-175b --gpus 64 --device device-flops.json
bad "hbm_gbps must be positive, got 0" plan --model gpt3-175b --gpus 64 --device device-hbm.json
bad "memory must be a positive number of bytes, got 0" plan --model gpt3-175b --gpus 64 --device device-memory.json
bad "memory must be a size such as 96GiB, got '0GiB'" plan --model gpt3-175b --gpus 64 --device custom:0GiB,900,3000
bad "--device is required to plan a multi-GPU run" plan --model gpt3-175b --gpus 64
bad "--tp 3 x --pp 2 x --dp 2 is 12 GPUs, not --gpus 8" plan --model gpt3-175b --gpus 8 --tp 3 --pp 2 --dp 2 --device h100-80gb
bad "--tp 1 x --pp 1 x --dp 2 is 2 GPUs, not --gpus 4" plan --gpus 4 --tp 1 --pp 1 --dp 2 --device cpu --budget 1GB
bad "--tp 1048576 x --pp 1048576 x --dp 1048576 is more than 1048576 GPUs" plan --model gpt3-175b --tp 1048576 --pp 1048576 --dp 1048576 --device h100-80gb
bad "--gpus must be in 1..1048576, got 0" plan --model gpt3-175b --gpus 0 --device a100-80gb
bad "--pp must be in 1..1048576, got 0" plan "${gpt3[@]}" --pp 0
bad "--micro-batch must be in 1..1048576, got -2" plan "${gpt3[@]}" --micro-batch -2
bad "--zero must be a ZeRO stage 0..3 (or -1: searched), got 4" plan "${gpt3[@]}" --zero 4
bad "bad --grad-dtype 'fp8'" plan "${gpt3[@]}" --grad-dtype fp8
bad "--optimizer-instances must be in 1..1048576, got 0" plan "${gpt3[@]}" --optimizer-instances 0
bad "--optimizer-instances 2 splits Megatron-LM's distributed optimizer (--zero 1); got --zero 0" plan "${gpt3[@]}" --zero 0 --optimizer-instances 2
bad "--optimizer-instances 2 splits Megatron-LM's distributed optimizer; --framework torchtitan has none" plan "${gpt3[@]}" --framework torchtitan --optimizer-instances 2
bad "--optimizer-instances 4 must divide the data- x context-parallel ranks, --dp 2 x --cp 1: give a divisor of 2" plan --model gpt3-175b --device a100-80gb --tp 8 --pp 8 --dp 2 --optimizer-instances 4
bad "--optimizer-instances 3 must divide the data- x context-parallel ranks, which divide --gpus 64: give a divisor of 64" plan "${gpt3[@]}" --optimizer-instances 3
bad "--loss fused is Megatron-LM's fused cross-entropy, modelled for dtype bf16 only (its gradient is made in bf16; under another dtype a cast follows, not measured); got fp16" plan "${gpt3[@]}" --dtype fp16 --loss fused
bad "--budget and --reserve both" plan "${gpt3[@]}" --budget 70GiB --reserve 1GiB
bad "is a budget; a layout plans each stage" plan "${gpt3[@]}" --policies budget:50%
bad "--top must be in 1..100, got 0" plan "${gpt3[@]}" --top 0
bad "--costs is for a one-process plan (no --device, --gpus or other layout flag)" plan "${gpt3[@]}" --costs estimated
bad "--reserve takes a size such as 2GiB, got '0'" plan "${gpt3[@]}" --reserve 0
bad "--cublas-workspace takes a size such as 32MiB, got '12XB'" plan "${gpt3[@]}" --cublas-workspace 12XB
bad "bad --device 'custom:80GiB,900,3000,'; write custom:MEM,TFLOPS,GBPS" plan --model gpt3-175b --gpus 64 --device custom:80GiB,900,3000,
# ---- output files: refused before any work, nothing replaced --------------------------------------
bad "--json 'llama.json' is the same file as --model-config 'llama.json'" plan --model-config llama.json --budget 1GB --json llama.json
bad "--json 'llama.json' is the same file as --model-config 'llama.json'" plan --model-config llama.json --gpus 2 --global-batch 2 --device h100-80gb --json llama.json
bad "--model-config 'arch-number.json': \"architectures\" and \"model_type\" hold strings" plan --model-config arch-number.json --budget 1GB
bad "cannot write '/nonexistent-dir/r.json'" bench "${tiny[@]}" --json /nonexistent-dir/r.json
bad "cannot write '/nonexistent/x.md'" bench "${tiny[@]}" --markdown /nonexistent/x.md
bad "cannot write 'folder': it is a directory" bench "${tiny[@]}" --csv folder
bad "unknown format '.jpg'" bench "${tiny[@]}" --chart c.jpg
bad "unknown format '.svg;id'" bench "${tiny[@]}" --chart 'x.svg;id'
bad "unknown format" bench "${tiny[@]}" --chart 'x$(id>&2).jpg' --json keep.json
bad "cannot write '/nonexistent/a.csv'" train --csv /nonexistent/a.csv --data "$box/text.txt"
bad "chart 'a.gif': unknown format '.gif'" train --chart a.gif --data "$box/text.txt"
bad "cannot save a train state in 'keep.json': it is not a folder" train --save keep.json --data "$box/text.txt"
bad "cannot save a train state in '/proc/nope'" train --save /proc/nope --data "$box/text.txt"
# ---- training options ---------------------------------------------------------------------------
bad "--steps must be >= 1, got 0" train --steps 0
bad "--accum must be in 1..65536, got 0" train --accum 0
bad "--weight-decay must be a finite number >= 0, got nan" train --weight-decay nan --steps 1
bad "--clip must be a finite number >= 0 (0 = off), got nan" train --clip nan --steps 1
bad "--lr inf and --min-lr" train --lr inf --steps 1
bad "--lr -1 and --min-lr" train --lr -1
bad "--save-every must be >= 0, got -3" train --save-every -3
bad "--eval-every must be >= 0" train --eval-every -1
bad "--seed: '-1' is out of range (0..18446744073709551615)" train --seed -1 --steps 1
bad "remat train trains token models" train --arch seed
bad "--nproc must be in 1..256, got 0" train --nproc 0
bad "--zero must be 0 or 1" train --zero 2 --nproc 2 --data "$box/text.txt"
bad "--zero 1 shards the Adam moments over ranks; give --nproc 2" train --zero 1 --data "$box/text.txt"
bad "--master 'foo' must be ADDR:PORT" train --master foo --rank 0 --world-size 2
bad "the port must be in 1..65535" train --rank 0 --world-size 2 --master 127.0.0.1:99999
bad "--rank, --world-size and --master ADDR:PORT go together" train --rank 0
bad "--dist-timeout must be a positive number of seconds, got 0" train --dist-timeout 0
bad "--bucket-mb must be in (0, 4096], got 0" train --bucket-mb 0
bad "--memory-limit takes a size such as 2GiB or 300MiB, got '60%'" train --memory-limit 60% --data "$box/text.txt"
bad "--memory-limit takes a size such as 2GiB or 300MiB, got '3XB'" train --memory-limit 3XB --data "$box/text.txt"
bad "policy 'none' peaks at" train --memory-limit 20MiB --data "$box/text.txt"
# ---- input files: data and train states ---------------------------------------------------------
bad "cannot read --data '/nonexistent/t.txt'" train --data /nonexistent/t.txt
bad "cannot read --data '/nonexistent/t.txt'" train --nproc 2 --data /nonexistent/t.txt
bad "--data was given an empty value" train --data '' --steps 1
bad "--data 'folder' is a folder; give a text file" train --data folder --steps 1
bad "--data 'fifo' is a FIFO; give a text file" train --data fifo --steps 1
bad "--data '/dev/zero' is a device; give a text file" train --data /dev/zero --steps 1
bad "has 4 bytes; with --seq 128 and 10% held out it needs at least 1290" train --data tiny.txt --steps 1
bad "cannot read train state '/nonexistent/state.bin'" train --resume /nonexistent
bad "train state 'fifo_run/state.bin' is a FIFO; give the folder passed to --save" train --resume fifo_run
bad "is corrupt or truncated" train --resume garbage
bad "is corrupt or truncated" train --resume truncated
bad "train state 'earlier/state.bin' was written by an earlier remat (format REMATTS1)" train --resume earlier
bad "--dim 32 differs from the run saved in 'run' (16)" train --resume run --dim 32
bad "the run in 'run' already finished its 2 steps" train --resume run --data "$box/text.txt"
bad "the run in 'run' was trained with 1 ATen thread(s)" train --resume run --threads 2/1 --data "$box/text.txt"
# Under --nproc the launcher refuses a resume before it starts a rank, as one process would.
bad "--lr 0.5 differs from the run saved in 'run' (0.003)" train --nproc 2 --resume run --lr 0.5 --data "$box/text.txt"
bad "--nproc 2 differs from the run saved in 'run' (1)" train --nproc 2 --resume run --data "$box/text.txt"
bad "cannot read train state '/nonexistent/state.bin'" sample --load /nonexistent
bad "train state 'fifo_run/state.bin' is a FIFO" sample --load fifo_run
bad "is corrupt or truncated" sample --load garbage
bad "--load is required" sample
bad "--tokens must be in 0..1000000" sample --load run --tokens 99999999999
bad "--temperature must be finite and at least 1e-06, got -1" sample --load run --temperature -1
bad "--temperature must be finite and at least 1e-06, got 1e-320" sample --load run --temperature 1e-320
bad "--top-k must be in 0..256 (0 = all), got -2" sample --load run --top-k -2
bad "--prompt was given an empty value" sample --load run --prompt ''
# ---- what a command reads and writes: no output replaces an input, no saved run is restarted ------
bad "--csv 'text.txt' is the same file as --data 'text.txt'" train --data text.txt --csv text.txt --steps 1
bad "--json 'dev.json' is the same file as --device 'dev.json'" plan --model gpt3-175b --gpus 64 --device dev.json --json dev.json
bad "--csv 'keep.json' is the same file as --json 'keep.json'" bench "${tiny[@]}" --json keep.json --csv keep.json
bad "--csv 'run/state.bin' and --save 'run' overlap" train --save run --csv run/state.bin --data "$box/text.txt"
bad "'run' holds a saved run; continue it with --resume run --save run" train --save run --data "$box/text.txt"
bad "'hard.csv': it has 2 hard links" bench "${tiny[@]}" --csv hard.csv
bad "--device 'fifo' is a FIFO; give a regular file" plan --model gpt3-175b --gpus 64 --device fifo
bad "--gemm \"linear=blas-threads,blas-threads,blas-threads;head=blas,blas,blas\" differs from the run saved in 'run' (\"linear=onednn,onednn,onednn;head=onednn,onednn,onednn\")" \
  train --resume run --gemm blas --data "$box/text.txt"
RANK=0 bad "--nproc 2 starts its own ranks, but RANK=0 is set" train --nproc 2 --data "$box/text.txt"
# ---- flags a device cannot honour, and work without bound ------------------------------------------
bad "--budget 200GiB is more than device a100-80gb has" plan "${gpt3[@]}" --budget 200GiB
bad "--tp is a GPU layout; --device cpu plans remat's own trainer" plan --device cpu --gpus 2 --tp 2 --layers 2 --dim 16 --heads 4 --seq 8
bad "--pp is a GPU layout" plan --device cpu --gpus 2 --pp 2 --layers 2 --dim 16 --heads 4 --seq 8
bad "--zero is a GPU layout" plan --device cpu --gpus 2 --zero 2 --layers 2 --dim 16 --heads 4 --seq 8
bad "--fsdp describes a GPU framework or PyTorch's allocator; --device cpu plans remat's own trainer" plan --device cpu --gpus 2 --fsdp --layers 2 --dim 16 --heads 4 --seq 8
bad "--dtype bf16: --device cpu plans remat's own trainer, which trains fp32" plan --device cpu --gpus 2 --dtype bf16 --layers 2 --dim 16 --heads 4 --seq 8
bad "--batch sizes a one-process plan; a multi-GPU plan takes --micro-batch and --global-batch" plan "${gpt3[@]}" --batch 4
bad "--grad-dtype bf16 is for mixed precision; --dtype fp32 keeps fp32 gradients" plan "${gpt3[@]}" --dtype fp32 --grad-dtype bf16
bad "--dispatcher: --arch gpt2 has no experts to dispatch tokens to" plan "${gpt3[@]}" --dispatcher alltoall
bad "--fsdp-root sets FSDP2's root unit; this plan does not shard with FSDP2" plan "${gpt3[@]}" --fsdp-root keep
bad "--reserve 100GiB is all of device a100-80gb's memory" plan "${gpt3[@]}" --reserve 100GiB
bad "--cublas-workspace 1TiB is all of device a100-80gb's memory" plan "${gpt3[@]}" --cublas-workspace 1TiB
bad "--reserve 10TiB is all of device cpu's memory" plan --device cpu --gpus 2 --layers 2 --dim 16 --heads 4 --seq 8 --reserve 10TiB
bad "--expert-imbalance sizes the busiest expert-parallel rank's tokens; a one-process plan" plan --arch moe --layers 2 --dim 16 --heads 4 --seq 8 --budget 1GB --expert-imbalance 2
bad "--vocab sizes a token model's embedding and LM head; the seed block" plan --arch seed --vocab 1000 --budget 1GB
bad "chunked:N needs N in 1..999999" bench --arch gpt2 --layers 2 --dim 16 --heads 4 --seq 8 --loss chunked:0
bad "the seed block takes no decoder choice (those are for gpt2 and llama); this model sets --head-dim" bench "${tiny[@]}" --head-dim 8
bad "--verify is for the op-level engine; add it to --engine" bench "${tiny[@]}" --engine module --verify
bad "--frontier draws the planner's frontier on the chart: give --chart" bench --arch gpt2 --layers 2 --dim 16 --heads 4 --seq 8 --frontier
bad "--master goes with --rank and --world-size" train --master 10.0.0.1:29500 --data "$box/text.txt"
bad "--bucket-mb is for a data-parallel run" train --bucket-mb 4 --data "$box/text.txt"
bad "--save-every 5 saves the train state every so many steps; give --save DIR too" train --save-every 5 --data "$box/text.txt"
bad "--accum 40000 on 2 ranks is 80000 micro-batches a step; at most 65536" train --nproc 2 --accum 40000 --data "$box/text.txt"
bad "budget 1000 B cannot be met: the smallest peak any policy reaches is" train --policy budget:1KB --data "$box/text.txt"
bad "--global-batch must be in 1..1048576" plan "${gpt3[@]}" --global-batch 1099511627776
bad "--policies lists 'full' twice" plan "${gpt3[@]}" --policies full,full
bad "--first-stage-layers and --last-stage-layers split a pipeline together" plan "${gpt3[@]}" --first-stage-layers 2
bad "--first-stage-layers 2 + --last-stage-layers 3 leave 91 of the 96 layers" plan "${gpt3[@]}" --pp 4 --first-stage-layers 2 --last-stage-layers 3
bad "--policies lists 'full' twice" bench "${tiny[@]}" --policies full,none,full
bad "--warmup must be in 0..10000, got 2000000000" bench "${tiny[@]}" --warmup 2000000000
bad "--eval-batches must be in 1..65536, got 2000000000" train --eval-batches 2000000000 --data "$box/text.txt"
bad "--accum must be in 1..65536, got 2000000000" train --accum 2000000000 --data "$box/text.txt"
bad "unknown policy term 'attn\\nfull'" plan "${gpt3[@]}" --policies "$(printf 'attn\nfull')"
# A kernel above this CPU's best (SIGILL at its first product if accepted).
above=$(grep -qw avx512f /proc/cpuinfo || echo SkylakeX)
if [ -n "$above" ]; then bad "--blas-kernel $above needs instructions this CPU lacks" bench "${tiny[@]}" --blas-kernel "$above"; fi

if [ "$failures" -ne 0 ]; then echo "$failures of $cases bad-input cases failed"; exit 1; fi
echo "$cases bad-input cases: each refused with exit 2 and one line, before any work, touching no file"
