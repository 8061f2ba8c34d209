#!/usr/bin/env bash
# Installs the Debian packages remat needs (only the missing ones) and checks that OpenBLAS is the
# BLAS that LibTorch will load. Idempotent; `make run` and `make test` call it first. `setup.sh fuzz`
# adds clang and its libFuzzer runtime (`make fuzz`); GCC's sanitizers (`make sanitize`) come with g++.
# `setup.sh eager` adds Debian's PyTorch (`make eager`).
set -euo pipefail

# The packages and paths below are Debian 12's for amd64 (the BLAS alternative is x86_64's).
arch=$(dpkg --print-architecture 2>/dev/null || uname -m)
if [ "$arch" != amd64 ] && [ "$arch" != x86_64 ]; then
  echo "setup: this is a $arch machine; remat's set-up is for Debian 12 on amd64 (x86-64)" >&2
  exit 1
fi

packages=(
  g++ cmake make ccache              # toolchain
  clang-format                       # make format, make format-check (CI)
  libtorch-dev                       # LibTorch 1.13.1, CPU; brings libdnnl2 (oneDNN 2.6), whose sgemm the engine calls
  libgloo-dev                        # headers of c10d's Gloo process group (data-parallel training)
  libopenblas0-pthread               # fast BLAS behind libblas.so.3 (reference BLAS is ~28x slower)
  libgtest-dev                       # GoogleTest
  libcli11-dev libfmt-dev nlohmann-json3-dev
  gnuplot-nox                        # charts (PNG and SVG)
  fortunes                           # default training corpus for `remat train`
  python3                            # tools/validate.py (make validate, the validation test)
  procps                             # pgrep: tools/dp_test.sh finds the ranks it signals
)
if [ "${1:-}" = fuzz ]; then
  packages+=(clang libclang-rt-dev)  # libFuzzer and clang's ASan/UBSan runtimes
fi
if [ "${1:-}" = eager ]; then
  packages+=(python3-torch)          # PyTorch 1.13 for tools/eager_compare.py (make eager)
fi

missing=()
for p in "${packages[@]}"; do
  if ! dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed"; then
    missing+=("$p")
  fi
done

sudo=""
if [ "$(id -u)" -ne 0 ]; then
  if command -v sudo >/dev/null 2>&1; then sudo="sudo"; fi
fi

if [ ${#missing[@]} -gt 0 ]; then
  if [ "$(id -u)" -ne 0 ] && [ -z "$sudo" ]; then
    echo "setup: missing packages: ${missing[*]}; run as root: apt-get install ${missing[*]}" >&2
    exit 1
  fi
  echo "setup: installing ${missing[*]}"
  $sudo apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi

# libopenblas0-pthread registers itself as an alternative for libblas.so.3; make sure it won.
alt=libblas.so.3-x86_64-linux-gnu
want=/usr/lib/x86_64-linux-gnu/openblas-pthread/libblas.so.3
current=$(update-alternatives --query "$alt" 2>/dev/null | sed -n 's/^Value: //p')
if [ "$current" != "$want" ]; then
  echo "setup: libblas.so.3 points to '${current:-nothing}'; switching it to OpenBLAS"
  $sudo update-alternatives --set "$alt" "$want"
fi
