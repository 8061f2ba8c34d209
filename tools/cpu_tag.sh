#!/bin/sh
# The kind of CPU this machine has, as the name of the folder its results are kept in
# (results/by-cpu/NAME): vendor, family, model and the widest vector unit the CPU shows, such as
# intel-6-167-avx512 or amd-25-17-avx2. A VM's model name is often the vendor's line alone, so
# the name is built from the numbers. Usage: cpu_tag.sh [CPUINFO] (default /proc/cpuinfo).
exec awk -F': *' '
  /^vendor_id/ { v = ($2 == "GenuineIntel") ? "intel" : ($2 == "AuthenticAMD") ? "amd" : "cpu" }
  /^cpu family/ { f = $2 }
  /^model[ \t]*:/ { m = $2 }
  /^flags/ { w = ($2 ~ /(^| )avx512f( |$)/) ? "avx512" : ($2 ~ /(^| )avx2( |$)/) ? "avx2" : "sse" }
  /^$/ { exit }
  END { printf "%s-%s-%s-%s\n", v ? v : "cpu", f != "" ? f : "x", m != "" ? m : "x", w ? w : "sse" }
' "${1:-/proc/cpuinfo}"
