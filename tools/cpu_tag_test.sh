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
expect cpu-x-x-sse 'vendor_id\t: SomethingElse\nflags\t\t: sse sse2'

# This machine's own name has the same form.
if ! "$tag" | grep -qE '^(intel|amd|cpu)-[0-9A-Za-z]+-[0-9A-Za-z]+-(avx512|avx2|sse)$'; then
  echo "FAIL: this machine's name is $("$tag")"
  failures=$((failures + 1))
fi

[ "$failures" -eq 0 ] && echo "cpu_tag: all names as expected"
exit $((failures > 0))
