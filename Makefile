# The front door. `make run`: set up, build, run the seed experiment. `make test`: set up, build, test.
SHELL := /bin/bash
# A command piped into tee fails the target when the command fails.
.SHELLFLAGS := -o pipefail -c
BUILD ?= build
JOBS  ?= $(shell nproc)
CMAKE_FLAGS ?=

.PHONY: run test check sanitize fuzz setup build clean gpt2 planner train layouts flash llama moe dp eager profile validate format format-check

# A copy of results for this kind of CPU, in results/by-cpu/KIND/ (KIND from `remat cpu --kind`,
# such as amd-25-17-avx2): a run on another kind of CPU replaces results/FILE but not this copy.
keep_by_cpu = k=$$($(BUILD)/remat cpu --kind) && d=results/by-cpu/$$k && mkdir -p $$d && for f in $(1); do \
  b=$$(basename $$f) && cp $$f $$d/.$$b.tmp && mv $$d/.$$b.tmp $$d/$$b || exit 1; done

# The seed experiment: 6 layers, dim 512, batch 8, seq 128; none, full, every:2, every:3, on
# the module path (torch::nn + remat::checkpoint) and on the op-level engine.
run: build
	$(BUILD)/remat bench --json results/seed.json --csv results/seed.csv --markdown results/seed.md \
	  --chart results/seed.png --chart results/seed.svg
	$(call keep_by_cpu,results/seed.md results/seed.json)

# GPT-2 blocks at seq 1024 with dropout 0.1 (GPT-2's own setting), per-tensor policies on the engine.
gpt2: build
	$(BUILD)/remat bench --arch gpt2 --seq 1024 --dropout 0.1 \
	  --policies none,attn,mlp-act,attn+mlp-act,norm,full,every:2 --steps 5 --warmup 1 \
	  --json results/gpt2.json --csv results/gpt2.csv --markdown results/gpt2.md \
	  --chart results/gpt2.png --chart results/gpt2.svg

# The planner against the presets: plans at 20/40/60/80% of none's activation memory, measured in
# the same round-robin run as the presets that fit under 80% (and none, the reference); predicted
# and measured peak side by side.
planner: build
	$(BUILD)/remat bench --arch gpt2 --seq 1024 --dropout 0.1 --frontier \
	  --policies "budget:20%,budget:40%,budget:60%,budget:80%,none,attn,attn+mlp-act,full,every:2" \
	  --steps 5 --warmup 1 --json results/planner.json --csv results/planner.csv --markdown results/planner.md \
	  --chart results/planner.png --chart results/planner.svg

# A byte-level GPT on Debian's English fortunes with the default settings, its
# loss chart, and a sample from the trained model. It trains into runs/fortunes.new, which
# replaces runs/fortunes (a run of its own, from an earlier `make train`) once it completes.
train: build
	rm -rf runs/fortunes.new
	$(BUILD)/remat train --save runs/fortunes.new --csv results/train.csv --chart results/train.png --chart results/train.svg \
	  | tee results/train.txt
	rm -rf runs/fortunes.old && { [ ! -e runs/fortunes ] || mv runs/fortunes runs/fortunes.old; }
	mv runs/fortunes.new runs/fortunes && rm -rf runs/fortunes.old
	$(BUILD)/remat sample --load runs/fortunes --prompt "The meaning of life is" --tokens 400 --seed 7 | tee results/sample.txt
	rm -rf runs/moe.new
	$(BUILD)/remat train --arch moe --steps 200 --save runs/moe.new | tee results/train-moe.txt
	rm -rf runs/moe && mv runs/moe.new runs/moe

# Multi-GPU plans: the fastest layouts for GPT-3 175B on 64 A100s, LLaMA-70B on 16 H100s and a 1T
# model on 512 A100s, and Korthikanti et al.'s Table 3 models under their four settings.
layouts: build
	@for m in "gpt3-175b --gpus 64 --device a100-80gb" "llama2-70b --gpus 16 --device h100-80gb" \
	          "megatron-1t --gpus 512 --device a100-80gb"; do \
	  echo "\$$ remat plan --model $$m --top 3"; $(BUILD)/remat plan --model $$m --top 3 || exit 1; echo; \
	done | tee results/layouts.txt
	tools/table3.sh $(BUILD)/remat | tee results/table3.md

# The planner against per-GPU memory others measured on real training runs (validation/cases.json,
# each with its source) and torchtitan's step measured on an H200 by tools/gpu_memory.py
# (validation/h200.json): docs/validation.md with every case's ratio and the runs remat cannot
# express.
validate: build
	tools/validate.py --remat $(BUILD)/remat --cases validation/cases.json --markdown docs/validation.md

# Fused (flash) attention against math attention on GPT-2 blocks (width 512, 8 heads, dropout 0.1):
# batch 8 at T = 1024 and 2048, in one round-robin run each; batch 2 at T = 4096 (both) and 8192
# (flash only: math attention's predicted peak does not fit this machine).
flash: build
	$(BUILD)/remat bench --arch gpt2 --seq 1024 --dropout 0.1 --attention math,flash \
	  --policies none,attn,mlp-act,full --steps 3 --warmup 1 --markdown results/flash-1024.md --json results/flash-1024.json
	$(BUILD)/remat bench --arch gpt2 --seq 2048 --dropout 0.1 --attention math,flash \
	  --policies none,attn,full --steps 2 --warmup 1 --markdown results/flash-2048.md --json results/flash-2048.json
	$(BUILD)/remat bench --arch gpt2 --seq 4096 --batch 2 --dropout 0.1 --attention math,flash \
	  --policies none --steps 1 --warmup 1 --markdown results/flash-4096.md --json results/flash-4096.json
	$(BUILD)/remat bench --arch gpt2 --seq 8192 --batch 2 --dropout 0.1 --attention flash \
	  --policies none,full --steps 1 --warmup 0 --markdown results/flash-8192.md --json results/flash-8192.json
	-$(BUILD)/remat bench --arch gpt2 --seq 8192 --batch 2 --dropout 0.1 --attention math --policies none \
	  --steps 1 --warmup 0 2>&1 | tail -1 | tee results/flash-8192-math.txt

# The mixture of experts (8 experts of width 1024, 2 per token) under its presets, every recompute
# verified bitwise (--verify).
moe: build
	$(BUILD)/remat bench --arch moe --ffn 1024 --verify --engine ops \
	  --policies none,moe-act,moe,attn,full,every:2 --markdown results/moe.md --json results/moe.json

# Where the seed's `none` step spends its time, op by op, and (where CMake built it) oneDNN's rate
# in attention's product loops on one thread (docs/performance.md).
profile: build
	$(BUILD)/remat bench --engine ops --policies none --steps 3 --warmup 1 --profile | tee results/profile.txt
	$(call keep_by_cpu,results/profile.txt)
	@if [ -x $(BUILD)/attention_gemm_loops ]; then \
	  OMP_NUM_THREADS=1 $(BUILD)/attention_gemm_loops | tee results/attention_gemm_loops.txt && \
	  $(call keep_by_cpu,results/attention_gemm_loops.txt); fi

# The LLaMA block (RMSNorm, rotary embeddings, SwiGLU, grouped-query attention) under per-tensor
# policies, every recompute verified bitwise (--verify).
llama: build
	$(BUILD)/remat bench --arch llama --heads 8 --kv-heads 2 --verify --engine ops \
	  --policies none,attn,mlp-act,norm,attn+mlp-act,full,every:2 --steps 3 --warmup 1 \
	  --markdown results/llama.md --json results/llama.json

# Data parallel against one process on this machine's 2 cores, at the same global batch of 16
# sequences (40 steps of the default fortunes model each), and bytes per rank with ZeRO-1.
dp: build
	@( set -e; \
	  for a in "--nproc 2 --batch 8" "--nproc 2 --batch 8 --zero 1" "--batch 8 --accum 2" "--batch 16" \
	           "--batch 8 --accum 2 --threads 1/1"; do \
	    echo "\$$ remat train --steps 40 --eval-every 0 $$a"; $(BUILD)/remat train --steps 40 --eval-every 0 $$a 2>/dev/null; echo; \
	  done ) | tee results/dp.txt

# The seed experiment's four strategies on remat's engine and in PyTorch 1.13 eager (Debian's
# python3-torch, the same OpenBLAS), in alternating rounds.
eager: build
	scripts/setup.sh eager
	tools/eager_compare.py --remat $(BUILD)/remat --rounds 5 --steps 3 --json results/eager.json --markdown results/eager.md
	$(call keep_by_cpu,results/eager.md results/eager.json)

test: build
	cd $(BUILD) && ctest --output-on-failure -j$(JOBS)

# The unit tier only (ctest -L unit): the library's tests, no CLI launches, no second build.
check: build
	cd $(BUILD) && ctest --output-on-failure -j$(JOBS) -L unit

# libFuzzer (clang, with ASan + UBSan) on the policy grammar, the size and budget parsers, config
# validation, the train-state loader and the data loader: FUZZ_SECONDS each (default 60), starting
# from the seed corpora in fuzz/corpus/ (read only; new inputs go to $(FUZZ_BUILD)/corpus/). A crash
# leaves its input in $(FUZZ_BUILD)/crashes/ and fails the target.
FUZZ_BUILD ?= build-fuzz
FUZZ_SECONDS ?= 60
FUZZ_TARGETS ?= fuzz_policy fuzz_sizes fuzz_config fuzz_train_state fuzz_data
fuzz:
	@scripts/setup.sh fuzz
	@CC=clang CXX=clang++ cmake -S . -B $(FUZZ_BUILD) -DCMAKE_BUILD_TYPE=Release -DREMAT_FUZZ=ON -DREMAT_TESTS=OFF >/dev/null
	@cmake --build $(FUZZ_BUILD) -j$(JOBS) --target $(FUZZ_TARGETS)
	@mkdir -p $(FUZZ_BUILD)/crashes
	@for t in $(FUZZ_TARGETS); do \
	  mkdir -p $(FUZZ_BUILD)/corpus/$$t; \
	  echo "fuzz: $$t for $(FUZZ_SECONDS) s"; \
	  ASAN_OPTIONS=detect_leaks=0 $(FUZZ_BUILD)/$$t -max_total_time=$(FUZZ_SECONDS) -timeout=20 -rss_limit_mb=4096 \
	    -print_final_stats=1 -artifact_prefix=$(FUZZ_BUILD)/crashes/$$t- \
	    $(FUZZ_BUILD)/corpus/$$t fuzz/corpus/$$t 2>&1 | grep -E "^(#[0-9]+ *DONE|stat::number_of_executed_units|==[0-9]+==ERROR|SUMMARY)|Done [0-9]+ runs" ; \
	  test $${PIPESTATUS[0]} -eq 0 || { echo "fuzz: $$t found a crash: $(FUZZ_BUILD)/crashes/"; exit 1; }; \
	done

# The whole suite under AddressSanitizer + UndefinedBehaviorSanitizer (any report fails the test),
# in its own build folder; the tracking allocator's free-block cache is off there. CI runs it after
# `make test`. It is slower than the plain suite.
SANITIZE_BUILD ?= build-sanitize
sanitize: setup
	@cmake -S . -B $(SANITIZE_BUILD) -DCMAKE_BUILD_TYPE=Release -DREMAT_SANITIZE=ON >/dev/null
	@cmake --build $(SANITIZE_BUILD) -j$(JOBS)
	cd $(SANITIZE_BUILD) && ASAN_OPTIONS=detect_leaks=1:abort_on_error=1 UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1 \
	  ctest --output-on-failure -j$(JOBS)

setup:
	@scripts/setup.sh

# clang-format (the house style in .clang-format) over every C++ file git tracks: `make format`
# rewrites them, `make format-check` lists the ones that differ and fails (CI runs it first).
FORMAT_FILES = $(shell git ls-files '*.cpp' '*.h')
format: setup
	@clang-format -i $(FORMAT_FILES)
format-check: setup
	@clang-format --dry-run -Werror $(FORMAT_FILES) && echo "format: $(words $(FORMAT_FILES)) files as .clang-format says"

build: setup
	@cmake -S . -B $(BUILD) -DCMAKE_BUILD_TYPE=Release $(CMAKE_FLAGS) >/dev/null
	@cmake --build $(BUILD) -j$(JOBS)

clean:
	rm -rf $(BUILD)
