#!/usr/bin/env bash
# Build an offline wheelhouse for a GPU node from a pinned list (envs/gpu-lane.txt by default):
# one wheel per line for CPython 3.12 on Linux x86-64, downloaded on a machine with internet;
# pure-Python packages published only as source are built into wheels here.
#   bash tools/gpu_wheelhouse.sh envs/gpu-lane.txt wheelhouse
# On the node (no internet):
#   python3 -m pip install --no-index --no-deps --find-links wheelhouse -r envs/gpu-lane.txt
set -euo pipefail
list=${1:-envs/gpu-lane.txt}
out=${2:-wheelhouse}
python=${PYTHON:-python3}
mkdir -p "$out"
platforms=()
for tag in manylinux_2_35 manylinux_2_34 manylinux_2_31 manylinux_2_28 manylinux_2_27 \
  manylinux_2_24 manylinux_2_17 manylinux2014 manylinux1; do
  platforms+=(--platform "${tag}_x86_64")
done
grep -Ev '^\s*(#|$)' "$list" | while read -r requirement; do
  if ! PIP_CONSTRAINT= "$python" -m pip download -q --no-deps --only-binary=:all: \
    --python-version 3.12 --implementation cp "${platforms[@]}" -d "$out" "$requirement"; then
    echo "no binary wheel for $requirement: building it from source (pure Python)"
    PIP_CONSTRAINT= "$python" -m pip wheel -q --no-deps -w "$out" "$requirement"
  fi
done
echo "wheelhouse: $(ls "$out" | wc -l) wheels in $out"
