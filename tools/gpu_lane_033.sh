#!/usr/bin/env bash
# The vLLM 0.33.0 GPU lane on a machine without a registry, from tools/gpu_carry_033.sh's parts.
#   bash tools/gpu_lane_033.sh parts OUT             unpack what arrived in .carry/parts; check
#                                                    `import torch` / `import vllm` once unpacked
#   bash tools/gpu_lane_033.sh tests OUT SECONDS GROUP...   pytest groups side by side on the GPU
#   bash tools/gpu_lane_033.sh perf OUT SECONDS      capture speed (perf/gpu_capture.py, llama8b:
#                                                    plain prefill, hooks under V2, native)
# GROUPs: capture (test_gpu_capture.py), qwen (Qwen3, Qwen3-MoE), mla (DeepSeek-V3, Kimi-K2.5),
# other (GPT-OSS, Llava), workflow (test_gpu_workflow.py). Logs and the failures' report land in
# OUT/lane-logs.tar.gz; tools/gpu_lane_report.py turns them into docs/results JSON.
set -uo pipefail
site=${GPU_SITE:-/tmp/carry/site}
mode=$1
out=$2
mkdir -p "$out" "$out/logs"

smoke() {
  # shellcheck source=/dev/null
  source tools/gpu_lane_env.sh "$site"
  if [[ -f $site/.unpacked-torch && ! -f $site/.torch-ok ]]; then
    python3 -c '
import torch, torch.distributed as dist
a = torch.randn(2048, 2048, device="cuda", dtype=torch.bfloat16)
print("torch", torch.__version__, torch.version.cuda, torch.cuda.get_device_name(),
      "nccl available", dist.is_nccl_available(), "matmul", float((a @ a).float().norm()) > 0)
' && touch "$site/.torch-ok"
  fi
  if [[ -f $site/.unpacked-stack && ! -f $site/.vllm-ok ]]; then
    python3 -c '
import vllm, transformers, triton, torchvision
from vllm import LLM
print("vllm", vllm.__version__, "transformers", transformers.__version__,
      "triton", triton.__version__, "torchvision", torchvision.__version__)
' && touch "$site/.vllm-ok"
  fi
}

group_args() {
  case $1 in
  capture) echo tests/gpu/test_gpu_capture.py ;;
  qwen) echo tests/gpu/test_gpu_families.py -k qwen3 ;;
  mla) echo tests/gpu/test_gpu_families.py -k '"deepseek_v3 or kimi_k25"' ;;
  other) echo tests/gpu/test_gpu_families.py -k '"gpt_oss or llava"' ;;
  workflow) echo tests/gpu/test_gpu_workflow.py ;;
  *) echo "unknown group $1" >&2 && return 1 ;;
  esac
}

pack_logs() {
  tar -czf "$out/lane-logs.tar.gz" -C "$out" logs
  find "$out/logs" -delete
}

case $mode in
parts)
  bash tools/gpu_carry_unpack.sh
  smoke 2>&1 | tee "$out/logs/smoke.log"
  ;;
tests)
  seconds=$3
  shift 3
  bash tools/gpu_carry_unpack.sh
  smoke >"$out/logs/smoke.log" 2>&1
  nvidia-smi -L >"$out/logs/device.txt"
  export PYTHONUNBUFFERED=1
  pids=()
  for group in "$@"; do
    args=$(group_args "$group") || exit 1
    (
      export DRAFTFLOW_GPU_REPORT="$out/logs/$group-failures.txt"
      eval timeout "$seconds" python3 -m pytest -v -rA -p no:cacheprovider --durations=10 "$args"
    ) >"$out/logs/$group.log" 2>&1 &
    pids+=($!)
  done
  for pid in "${pids[@]}"; do wait "$pid"; done
  grep -hE "(PASSED|FAILED|SKIPPED|ERROR)( |$)" "$out"/logs/*.log | grep "::" | sort | tee "$out/outcomes.txt"
  pack_logs
  ;;
perf)
  seconds=$3
  bash tools/gpu_carry_unpack.sh
  smoke >"$out/logs/smoke.log" 2>&1
  export PYTHONUNBUFFERED=1
  # PERF_PROMPTS / PERF_REPEATS shorten the run where the machine's time is short; PERF_CHUNK
  # sets the store's samples per chunk (2 gave 0.24's headline, docs/results/gpu-capture-chunk2.json).
  timeout "$seconds" python3 perf/gpu_capture.py --root /tmp/gcap --model llama8b \
    --prompts "${PERF_PROMPTS:-256}" --repeats "${PERF_REPEATS:-2}" --length 1024 \
    --chunk-samples "${PERF_CHUNK:-8}" \
    --modes plain hooks-v2 native --out "$out/gpu-capture-033.json" \
    >"$out/logs/perf.log" 2>&1
  tail -5 "$out/logs/perf.log"
  pack_logs
  ;;
*)
  echo "usage: $0 parts|tests|perf OUT ..." >&2
  exit 2
  ;;
esac
