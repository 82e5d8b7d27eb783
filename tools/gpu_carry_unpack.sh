#!/usr/bin/env bash
# On the GPU machine: collect the carry's parts that arrived in .carry/parts (one call at a
# time) into STORE, and unpack every group whose parts have all arrived (SHA256SUMS lists them)
# into SITE, checked against their checksums. Prints what is still missing.
#   bash tools/gpu_carry_unpack.sh [STORE] [SITE]    (defaults /tmp/carry/parts, /tmp/carry/site)
set -euo pipefail
store=${1:-/tmp/carry/parts}
site=${2:-/tmp/carry/site}
mkdir -p "$store" "$site"
# Copied, not moved: run by mistake where the parts are built, it leaves them in place.
if [[ -d .carry/parts ]]; then
  find .carry/parts -maxdepth 1 -type f -exec cp -f {} "$store"/ \;
fi
[[ -f $store/SHA256SUMS ]] || { echo "no SHA256SUMS in $store yet"; exit 0; }
cd "$store"
for group in $(sed -E 's#.*\./([a-z]+)\.tar\.xz\..*#\1#' SHA256SUMS | sort -u); do
  [[ -f $site/.unpacked-$group ]] && { echo "$group: unpacked"; continue; }
  missing=$(grep "\./$group\.tar\.xz\." SHA256SUMS | awk '{print $2}' | while read -r f; do
    [[ -f $f ]] || echo "$f"; done)
  if [[ -n $missing ]]; then
    echo "$group: waiting for" $missing
    continue
  fi
  grep "\./$group\.tar\.xz\." SHA256SUMS | sha256sum -c --quiet -
  start=$(date +%s)
  cat ./"$group".tar.xz.* | xz -dc -T0 | tar -x -C "$site"
  touch "$site/.unpacked-$group"
  echo "$group: unpacked in $(( $(date +%s) - start )) s"
done
