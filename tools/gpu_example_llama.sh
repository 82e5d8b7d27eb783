#!/usr/bin/env bash
# config/examples/llama3.1-8b-8gpu.yaml end to end on ONE GPU, with a random-weight target of
# Llama-3.1-8B's shape, in one call of about ten minutes (issue 36, item 7):
#
#   source tools/gpu_lane_env.sh /tmp/carry/site && bash tools/gpu_example_llama.sh OUT
#
# Needs .carry/example-data (tools/gpu_example_data.py writes it where the data packages are
# installed; carry it with the tree) and ~40 GB of disk under $GPU_EXAMPLE_ROOT (/tmp/gpu-example).
#   1. tools/gpu_example_target.py draws the target on the GPU from
#      tests/data/targets/llama-3.1-8b/config.json (8.0B parameters, bf16 safetensors shards,
#      SmolLM2's tokenizer); a finished one there is kept (the same seed draws the same weights).
#   2. A fresh working directory (tests/workflow_support.py's copy of the workflow) with the
#      target and the data linked where the overlay names them, then
#      snakemake --configfile <example> config/examples/overlays/llama3.1-8b-one-gpu.yaml
#      --cores 16 --resources gpu=1 -- all results/extract/plan.json
#      (plan_extract: the disk plan the capture stores are checked against), stopped with SIGINT
#      where it would leave the collection less than 30 s of $GPU_EXAMPLE_SECONDS (570).
#   3. nvidia-smi samples the used GPU memory every 500 ms throughout.
#   4. tools/gpu_example_report.py: stage times, bytes written and peak GPU memory per engine,
#      against the engine plan (python -m draftflow.plan, also in the logs) and the disk plan.
# OUT receives gpu-example-llama.json (docs/results material) and gpu-example-logs.tar.gz (job
# logs, benchmark TSVs, Snakemake's log, the memory samples, the results' small files).
# For a check of this script's plumbing on a small machine: GPU_EXAMPLE_TARGET_ARGS (further
# arguments of tools/gpu_example_target.py, e.g. "--device cpu --set num_hidden_layers=8"),
# GPU_EXAMPLE_EXTRA_CONFIG (one more overlay, an absolute path, merged last) and GPU_EXAMPLE_TARGETS (Snakemake's
# targets; default "all results/extract/plan.json").
set -uo pipefail
out=${1:?usage: bash tools/gpu_example_llama.sh OUT}
root=${GPU_EXAMPLE_ROOT:-/tmp/gpu-example}
budget=${GPU_EXAMPLE_SECONDS:-570}
repo=$(pwd)
data=$repo/.carry/example-data
example=config/examples/llama3.1-8b-8gpu.yaml
overlay=config/examples/overlays/llama3.1-8b-one-gpu.yaml
configs="$example $overlay ${GPU_EXAMPLE_EXTRA_CONFIG:-}"
targets=${GPU_EXAMPLE_TARGETS:-all results/extract/plan.json}
target_config=$repo/tests/data/targets/llama-3.1-8b/config.json
began=$(date +%s)
mkdir -p "$out/logs" "$root"
out=$(cd "$out" && pwd)
logs=$out/logs
work=$root/work
if [[ ! -f $data/sharegpt.json ]]; then
  echo "no $data/sharegpt.json: run tools/gpu_example_data.py .carry/example-data and carry it" >&2
  exit 2
fi
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1

nvidia-smi -L >"$logs/device.txt" 2>&1
device_mib=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -1)
nvidia-smi --query-gpu=timestamp,memory.used --format=csv,noheader,nounits -lms 500 \
  >"$logs/gpu-memory.csv" 2>/dev/null &
sampler=$!

# 1. the target
build_began=$(date +%s)
built=reused
# a finished full-size target is kept (a small one of GPU_EXAMPLE_TARGET_ARGS never is)
if [[ -n ${GPU_EXAMPLE_TARGET_ARGS:-} || ! -f $root/target.built.json ]] ||
  ! grep -q '"overrides": {}' "$root/target.built.json"; then
  built=drawn
  if ! python3 tools/gpu_example_target.py --config "$target_config" \
    --tokenizer "$data/tokenizer" --out "$root/target" --device cuda ${GPU_EXAMPLE_TARGET_ARGS:-} \
    >"$logs/build-target.log" 2>&1; then
    kill "$sampler"
    tail -20 "$logs/build-target.log"
    tar -czf "$out/gpu-example-logs.tar.gz" -C "$out" logs && rm -r "$logs"
    exit 1
  fi
fi
build_s=$(($(date +%s) - build_began))
cp "$root/target.built.json" "$logs/"

# 2. the workflow in a fresh working directory
rm -rf "$work"
python3 -c 'import sys; sys.path.insert(0, "tests")
from pathlib import Path
from workflow_support import copy_workflow
copy_workflow(Path(sys.argv[1]))' "$work"
ln -s "$root/target" "$work/example-target"
ln -s "$data" "$work/example-data"
export PYTHONPATH="$work${PYTHONPATH:+:$PYTHONPATH}"
left=$((began + budget - 30 - $(date +%s)))
command="snakemake --configfile $configs --cores 16 --resources gpu=1 -- $targets"
snakemake_began=$(date +%s)
if ((left > 0)); then
  # shellcheck disable=SC2086  # the command's words
  (cd "$work" && timeout -s INT -k 20 "$left" python3 -m $command) >"$logs/snakemake.log" 2>&1
  snakemake_rc=$?
else
  echo "no time left for the workflow" >"$logs/snakemake.log"
  snakemake_rc=124
fi
snakemake_s=$(($(date +%s) - snakemake_began))
sleep 1
kill "$sampler"
tail -5 "$logs/snakemake.log"

# 4. the report
# shellcheck disable=SC2086  # the config files
(cd "$work" && python3 -m draftflow.plan --configfile $configs \
  --target-config "$target_config" --device-memory-gib "$(python3 -c "print($device_mib / 1024)")") \
  >"$logs/engine-plan.txt" 2>&1
python3 - "$logs/facts.json" <<EOF
import importlib.metadata as m, json, sys, time
def version(name):
    try:
        return m.version(name)
    except m.PackageNotFoundError:
        return None
facts = {
    "what": "config/examples/llama3.1-8b-8gpu.yaml on one GPU (overlay $overlay), random-weight Llama-3.1-8B target",
    "date": time.strftime("%Y-%m-%d"),
    "device": open("$logs/device.txt").read().strip(),
    "device_memory_mib": $device_mib,
    "versions": {p: version(p) for p in ("vllm", "torch", "transformers", "snakemake", "speculators")},
    "command": "(cd WORKDIR && python3 -m $command)",
    "target": {"built": "$built", "wall_s": $build_s, **json.load(open("$root/target.built.json"))},
    "snakemake": {"exit_code": $snakemake_rc, "wall_s": $snakemake_s, "stopped_by_time_limit": $snakemake_rc == 124, "limit_s": $left},
}
json.dump(facts, open(sys.argv[1], "w"), indent=2)
EOF
python3 tools/gpu_example_report.py --workdir "$work" --example "$example" \
  --configfile $configs --target-config "$target_config" \
  --snakemake-log "$logs/snakemake.log" --gpu-samples "$logs/gpu-memory.csv" \
  --device-memory-mib "$device_mib" --facts "$logs/facts.json" \
  --out "$out/gpu-example-llama.json" >"$logs/report.log" 2>&1 || tail -20 "$logs/report.log"

# the logs: job logs, benchmarks, Snakemake's log, the results' small files (no stores, no shards)
mkdir -p "$logs/workdir"
(cd "$work" && find logs benchmarks .snakemake/log results -type f -size -4M \
  ! -name '*.safetensors' ! -name '*.parquet' ! -path '*/checkpoints/*' 2>/dev/null |
  tar -cf - -T - | tar -xf - -C "$logs/workdir")
tar -czf "$out/gpu-example-logs.tar.gz" -C "$out" logs && rm -r "$logs"
ls -la "$out"
echo "total $(($(date +%s) - began)) s"
