#!/usr/bin/env bash
# Source on the GPU machine to run the lane on a carried stack (tools/gpu_carry_033.sh):
#   source tools/gpu_lane_env.sh /tmp/carry/site && make test-gpu GPU_STACK=033
# The carried folder goes first on PYTHONPATH, so its torch, vLLM and version metadata win over
# the image's. The image's NVIDIA libraries (cuBLAS, cuDNN, ..., NCCL 2.28.9) go on
# LD_LIBRARY_PATH, with torch's own libraries loaded globally: torch 2.14 links 11 NCCL symbols
# the image's NCCL lacks, which are then bound only if called (not at tensor parallel 1). A
# carried NCCL (the nccl group) comes first where it is there.
site=${1:?usage: source tools/gpu_lane_env.sh CARRIED_SITE}
site=$(cd "$site" && pwd)
image_site=$(env -u PYTHONPATH python3 -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
libs=""
for dir in "$site"/nvidia/nccl/lib "$image_site"/nvidia/*/lib "$image_site"/nvidia/cu13/lib; do
  [[ -d $dir ]] && libs="${libs:+$libs:}$dir"
done
export LD_LIBRARY_PATH="$libs${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
export PATH="$site/bin:$PATH"
export TORCH_USE_RTLD_GLOBAL=1
# torch 2.14 was built against cuDNN 9.24; the image has 9.19, which exports what it calls. The
# Llama and MLA paths on Hopper (FlashAttention 3, Triton) do not use cuDNN.
export PYTORCH_SKIP_CUDNN_COMPATIBILITY_CHECK=1
# The lane tests the hooks backend on this release before the gate lets users have it
# (draftflow/capture/adapters/__init__.py, HOOKS_VERSIONS).
export DRAFTFLOW_HOOKS_UNTESTED_VLLM=$(PYTHONPATH=$site python3 -c 'import importlib.metadata as m; print(m.version("vllm"))' 2>/dev/null)
# flashinfer is not carried (draftflow/engine.py sets this for its own engines too).
export VLLM_USE_FLASHINFER_SAMPLER=0
