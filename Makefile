# The front door. `make run`: set up, build, run the seed experiment. `make test`: set up, build, test.
BUILD ?= build
JOBS  ?= $(shell nproc)
CMAKE_FLAGS ?=

.PHONY: run test setup build clean gpt2 planner train layouts

# The seed note's experiment: 6 layers, dim 512, batch 8, seq 128; none, full, every:2, every:3, on
# the module path (torch::nn + remat::checkpoint) and on the op-level engine. About 1.5 minutes.
run: build
	$(BUILD)/remat bench --json results/seed.json --csv results/seed.csv --markdown results/seed.md \
	  --chart results/seed.png --chart results/seed.svg

# GPT-2 blocks at seq 1024 with dropout 0.1 (GPT-2's own setting), per-tensor policies on the engine.
# About 8 minutes on 2 cores.
gpt2: build
	$(BUILD)/remat bench --arch gpt2 --seq 1024 --dropout 0.1 \
	  --policies none,attn,mlp-act,attn+mlp-act,norm,full,every:2 --steps 5 --warmup 1 \
	  --json results/gpt2.json --csv results/gpt2.csv --markdown results/gpt2.md \
	  --chart results/gpt2.png --chart results/gpt2.svg

# The planner against the presets: plans at 20/40/60/80% of none's activation memory, measured in
# the same round-robin run as the presets that fit under 80% (and none, the reference); predicted
# and measured peak side by side. About 13 minutes.
planner: build
	$(BUILD)/remat bench --arch gpt2 --seq 1024 --dropout 0.1 --frontier \
	  --policies "budget:20%,budget:40%,budget:60%,budget:80%,none,attn,attn+mlp-act,full,every:2" \
	  --steps 5 --warmup 1 --json results/planner.json --csv results/planner.csv --markdown results/planner.md \
	  --chart results/planner.png --chart results/planner.svg

# A byte-level GPT on Debian's English fortunes with the default settings (about 10 minutes), its
# loss chart, and a sample from the trained model.
train: build
	$(BUILD)/remat train --save runs/fortunes --csv results/train.csv --chart results/train.png --chart results/train.svg \
	  | tee results/train.txt
	$(BUILD)/remat sample --load runs/fortunes --prompt "The meaning of life is" --tokens 400 --seed 7 | tee results/sample.txt

# Multi-GPU plans: the fastest layouts for GPT-3 175B on 64 A100s, LLaMA-70B on 16 H100s and a 1T
# model on 512 A100s, and Korthikanti et al.'s Table 3 models under their four settings. Seconds.
layouts: build
	@for m in "gpt3-175b --gpus 64 --device a100-80gb" "llama-70b --gpus 16 --device h100-80gb" \
	          "megatron-1t --gpus 512 --device a100-80gb"; do \
	  echo "\$$ remat plan --model $$m"; $(BUILD)/remat plan --model $$m --top 3 || exit 1; echo; \
	done | tee results/layouts.txt
	tools/table3.sh $(BUILD)/remat | tee results/table3.md

test: build
	cd $(BUILD) && ctest --output-on-failure -j$(JOBS)

setup:
	@scripts/setup.sh

build: setup
	@cmake -S . -B $(BUILD) -DCMAKE_BUILD_TYPE=Release $(CMAKE_FLAGS) >/dev/null
	@cmake --build $(BUILD) -j$(JOBS)

clean:
	rm -rf $(BUILD)
