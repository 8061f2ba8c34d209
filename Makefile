# The front door. `make run`: set up, build, run the seed experiment. `make test`: set up, build, test.
BUILD ?= build
JOBS  ?= $(shell nproc)
CMAKE_FLAGS ?=

.PHONY: run test setup build clean

run: build
	$(BUILD)/remat bench --json results/seed.json --csv results/seed.csv --chart results/seed.png --chart results/seed.svg --markdown results/seed.md

test: build
	cd $(BUILD) && ctest --output-on-failure -j$(JOBS)

setup:
	@scripts/setup.sh

build: setup
	@cmake -S . -B $(BUILD) -DCMAKE_BUILD_TYPE=Release $(CMAKE_FLAGS) >/dev/null
	@cmake --build $(BUILD) -j$(JOBS)

clean:
	rm -rf $(BUILD)
