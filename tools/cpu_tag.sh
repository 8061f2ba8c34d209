#!/bin/sh
# The kind of CPU this machine has, as the name of the folder its results are kept in
# (results/by-cpu/NAME). On x86: vendor, family, model and the widest vector unit the CPU shows,
# such as intel-6-167-avx512 or amd-25-17-avx2 (a VM's model name is often the vendor's line
# alone, so the name is built from the numbers). Elsewhere: the machine's architecture, the CPU's
# implementer and part (aarch64-0x41-0xd0c). Only letters, digits, '-' and '_'.
# Usage: cpu_tag.sh [CPUINFO] (default /proc/cpuinfo).
exec awk -F': *' -v arch="$(uname -m)" '
  function clean(s) { gsub(/[^A-Za-z0-9]/, "_", s); return s == "" ? "x" : s }
  /^vendor_id/ { v = ($2 == "GenuineIntel") ? "intel" : ($2 == "AuthenticAMD") ? "amd" : "x86_" clean($2) }
  /^cpu family/ { f = $2 }
  /^model[ \t]*:/ { m = $2 }
  /^flags/ { w = ($2 ~ /(^| )avx512f( |$)/) ? "avx512" : ($2 ~ /(^| )avx2( |$)/) ? "avx2" : "sse" }
  /^CPU implementer/ { impl = $2 }
  /^CPU part/ { part = $2 }
  /^$/ { exit }
  END {
    if (v != "") printf "%s-%s-%s-%s\n", v, clean(f), clean(m), w != "" ? w : "sse"
    else printf "%s-%s-%s\n", clean(arch), clean(impl), clean(part)
  }
' "${1:-/proc/cpuinfo}"
