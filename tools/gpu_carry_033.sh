#!/usr/bin/env bash
# Build the vLLM 0.33.0 stack (envs/gpu-lane-033.txt) as parts small enough to carry to a GPU
# machine without a registry: the wheels are downloaded for CPython 3.12 on Linux x86-64,
# installed with --no-deps into one folder per group, trimmed of what a Hopper GPU never loads,
# packed (tar | xz -1) and split into parts of PART_MB MiB.
#   bash tools/gpu_carry_033.sh [--nccl] [OUT]      (OUT defaults to .carry, ignored by git)
# Groups, in the order their parts are meant to travel:
#   torch  torch 2.14.0 alone, so `import torch` against the image's NCCL is tried first
#   stack  every other line of the list (triton, vLLM, transformers, draftflow's stages, ...)
#   nccl   nvidia-nccl-cu13 2.30.7, built only with --nccl, sent only where the image's NCCL fails
# On the GPU machine: cat OUT/parts/GROUP.tar.xz.* | xz -dc | tar -x -C SITE for each group,
# then `source tools/gpu_lane_env.sh SITE` (PYTHONPATH, LD_LIBRARY_PATH, vLLM's settings).
set -euo pipefail
nccl=0
if [[ ${1:-} == --nccl ]]; then
  nccl=1
  shift
fi
out=${1:-.carry}
list=${LIST:-envs/gpu-lane-033.txt}
part_mb=${PART_MB:-58}
python=${PYTHON:-python3}
wheels=$out/wheels
parts=$out/parts
mkdir -p "$wheels" "$parts"

platforms=()
for tag in manylinux_2_35 manylinux_2_34 manylinux_2_31 manylinux_2_28 manylinux_2_27 \
  manylinux_2_24 manylinux_2_18 manylinux_2_17 manylinux2014 manylinux1; do
  platforms+=(--platform "${tag}_x86_64")
done
target_flags=(--python-version 3.12 --implementation cp --only-binary=:all: "${platforms[@]}")

# A machine-wide pip constraint caps torch below 2.14: clear it for every pip call here.
pip_() { PIP_CONSTRAINT= "$python" -m pip "$@"; }

download() { # requirement...
  for requirement in "$@"; do
    if ! pip_ download -q --no-deps "${target_flags[@]}" -d "$wheels" "$requirement"; then
      echo "no binary wheel for $requirement: building it from source (pure Python)"
      pip_ wheel -q --no-deps -w "$wheels" "$requirement"
    fi
  done
}

wheel_of() { # requirement -> the downloaded wheel's path
  local name=${1%%==*}
  local version=${1#*==}
  local pattern
  pattern=$(echo "$name" | tr '[:upper:]-.' '[:lower:]__')
  find "$wheels" -maxdepth 1 -iname "${pattern}-${version}-*.whl" | head -1
}

install_group() { # group requirement...
  local group=$1
  shift
  local site=$out/site-$group
  local files=()
  for requirement in "$@"; do
    local wheel
    wheel=$(wheel_of "$requirement")
    if [[ -z $wheel ]]; then
      echo "missing wheel for $requirement" >&2
      exit 1
    fi
    files+=("$wheel")
  done
  # A fresh folder each build: pip --target refuses to overwrite what an earlier build left.
  if [[ -e $site ]]; then
    mv "$site" "$site.old.$$"
    find "$site.old.$$" -delete
  fi
  pip_ install -q --no-deps --no-compile --target "$site" "${target_flags[@]}" "${files[@]}"
}

# What a Hopper GPU running a dense, MoE or MLA target never loads (docs: the platform notes).
trim() {
  local site=$1
  local paths=(
    torch/include                                    # C++ headers: no extension is built there
    vllm/vllm_flash_attn/_vllm_fa2_C.abi3.so         # FlashAttention 2: FA3 serves Hopper
    vllm/vllm-rs                                     # the Rust front end of the API server
    vllm/third_party/fmha_sm100                      # SM100-only attention
    vllm/third_party/deep_gemm/include               # DeepGEMM's JIT headers (fp8 only)
    triton/backends/nvidia/bin/ptxas-blackwell       # sm >= 100 only
    triton/backends/nvidia/lib/cupti-blackwell       # the profiler's libraries
    triton/backends/nvidia/lib/cupti
  )
  for path in "${paths[@]}"; do
    if [[ -e $site/$path ]]; then
      find "$site/$path" -delete
    fi
  done
}

pack() { # group
  local group=$1
  local site=$out/site-$group
  find "$parts" -maxdepth 1 -name "$group.tar.xz.*" -delete
  tar -C "$site" -cf - . | xz -1 -T2 | split -b "${part_mb}M" -d -a 2 - "$parts/$group.tar.xz."
  echo "$group: $(du -sm "$site" | cut -f1) MiB installed, parts:"
  ls -l "$parts/$group.tar.xz."*
}

mapfile -t requirements < <(grep -Ev '^\s*(#|$)' "$list")
download "${requirements[@]}"
stack=()
for requirement in "${requirements[@]}"; do
  [[ $requirement == torch==* ]] || stack+=("$requirement")
done
install_group torch "$(printf '%s\n' "${requirements[@]}" | grep '^torch==')"
install_group stack "${stack[@]}"
trim "$out/site-torch"
trim "$out/site-stack"
pack torch
pack stack
if ((nccl)); then
  download nvidia-nccl-cu13==2.30.7
  install_group nccl nvidia-nccl-cu13==2.30.7
  pack nccl
fi
# Checksums of every part, checked on the GPU machine before unpacking.
(cd "$parts" && sha256sum ./*.tar.xz.* >SHA256SUMS)
echo "parts in $parts: $(du -cm "$parts"/*.tar.xz.* | tail -1 | cut -f1) MiB"
