#!/usr/bin/env bash
# tools/cpu_tag.sh names the kind of CPU from the first processor's fields: vendor, family, model
# and the widest vector unit. Usage: cpu_tag_test.sh
set -u
tag=$(dirname "$0")/cpu_tag.sh
box=$(mktemp -d)
trap 'rm -rf "$box"' EXIT
failures=0

# expect NAME FIELDS: the name cpu_tag.sh gives a /proc/cpuinfo holding FIELDS (one processor,
# then a second that must not be read).
expect() {
  printf '%b\n\nprocessor\t: 1\nvendor_id\t: AuthenticAMD\ncpu family\t: 99\nmodel\t\t: 99\nflags\t\t: avx2\n' "$2" \
    >"$box/cpuinfo"
  local got
  got=$("$tag" "$box/cpuinfo")
  if [ "$got" != "$1" ]; then
    echo "FAIL: expected $1, got $got, from: $2"
    failures=$((failures + 1))
  fi
}

expect intel-6-143-avx512 'vendor_id\t: GenuineIntel\ncpu family\t: 6\nmodel\t\t: 143\nmodel name\t: Intel(R) Xeon(R) Platinum 8480+\nflags\t\t: fpu avx avx2 fma avx512f avx512bw'
expect amd-25-17-avx2 'vendor_id\t: AuthenticAMD\ncpu family\t: 25\nmodel\t\t: 17\nmodel name\t: AMD EPYC\nflags\t\t: fpu avx avx2 fma'
expect amd-23-49-avx2 'vendor_id\t: AuthenticAMD\ncpu family\t: 23\nmodel\t\t: 49\nflags\t\t: avx2 avx512_fake'
expect intel-6-85_extra-sse 'vendor_id\t: GenuineIntel\ncpu family\t: 6\nmodel\t\t: 85 extra\nflags\t\t: sse sse2'
expect x86_HygonGenuine-24-0-avx2 'vendor_id\t: HygonGenuine\ncpu family\t: 24\nmodel\t\t: 0\nflags\t\t: avx2'
arch=$(uname -m | sed 's/[^A-Za-z0-9]/_/g')
expect "$arch-0x41-0xd0c" 'processor\t: 0\nBogoMIPS\t: 50.00\nFeatures\t: fp asimd sve\nCPU implementer\t: 0x41\nCPU part\t: 0xd0c'
expect "$arch-x-x" 'processor\t: 0'

# This machine's own name has the same form.
if ! "$tag" | grep -qE '^[A-Za-z0-9_]+-[A-Za-z0-9_]+-[A-Za-z0-9_]+(-(avx512|avx2|sse))?$'; then
  echo "FAIL: this machine's name is $("$tag")"
  failures=$((failures + 1))
fi

[ "$failures" -eq 0 ] && echo "cpu_tag: all names as expected"
exit $((failures > 0))
