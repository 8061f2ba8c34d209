#!/usr/bin/env bash
# The documents speak of the product: no project-history words in README.md, docs/ or the code's
# comments, a README a user reads in one sitting, and every relative link in them resolving.
# Usage: docs_test.sh SOURCE_DIR
set -u
cd "$1" || exit 1
fail=0
# The pattern is split so that this file does not match itself.
words='sess''ion|iss''ue [0-9]'
if hits=$(grep -rniE "$words" README.md CHANGELOG.md docs src include tools examples Makefile scripts 2>/dev/null); then
  echo "FAIL: project-history words (git keeps history; CHANGELOG.md keeps releases):"
  echo "$hits"
  fail=1
fi
size=$(wc -c < README.md)
if [ "$size" -ge 16384 ]; then
  echo "FAIL: README.md is $size bytes; keep it under 16 KiB and move detail to docs/"
  fail=1
fi
for doc in README.md CHANGELOG.md docs/*.md; do
  dir=$(dirname "$doc")
  # [text](target) links that are not URLs or in-page anchors; the anchor part is dropped.
  while IFS= read -r target; do
    path=${target%%#*}
    [ -z "$path" ] && continue
    [ -e "$dir/$path" ] || { echo "FAIL: $doc links to '$target', which does not exist"; fail=1; }
  done < <(awk '/^```/ { code = !code; next } !code' "$doc" | sed -E 's/`[^`]*`//g' | grep -oE '\]\([^)]+\)' |
           sed -E 's/^\]\((.*)\)$/\1/' | grep -vE '^(https?|mailto):' | grep -v '^#')
done
[ "$fail" -eq 0 ] && echo "docs: no history words, README.md $size bytes, every link resolves"
exit "$fail"
