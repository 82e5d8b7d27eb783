#!/usr/bin/env bash
# Issue 41's GPU pair (perf/streamed_vs_stored.py --gpu) on a machine where the carry of
# tools/gpu_carry_033.sh has arrived, in two commands that each fit one device call:
#   bash tools/gpu_streamed_pair.sh stored OUT SECONDS    the demo target, the upstream run, the
#                                                         stored run
#   bash tools/gpu_streamed_pair.sh streamed OUT SECONDS  the streamed run (window 1) on the
#                                                         upstream run the first left
# Each writes OUT/streamed-vs-stored-gpu-RUNS.json and, finished or cut, the workdirs'
# benchmarks/ and logs/ as OUT/RUNS-jobs.tar.gz.
set -uo pipefail
runs=$1
out=$2
seconds=$3
work=/tmp/streamed
target=/tmp/smollm2
bash tools/gpu_carry_unpack.sh
# shellcheck source=/dev/null
source tools/gpu_lane_env.sh "${GPU_SITE:-/tmp/carry/site}"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD:$PYTHONPATH"  # draftflow from this checkout
keep_jobs() {
  (cd "$work" && find . -maxdepth 2 \( -name benchmarks -o -name logs \) -print0 |
    tar -czf "$out/$runs-jobs.tar.gz" --null -T -)
}
trap keep_jobs EXIT
if [[ ! -f $target/draftflow_target.json ]]; then
  python3 -c '
import sys; from pathlib import Path
sys.path.insert(0, "tests")
from config_support import demo_target
from draftflow.target.prepare import prepare_configured_target
prepare_configured_target(Path(sys.argv[1]), demo_target())
' "$target" || exit 1
fi
keep=()
[[ $runs == streamed ]] && keep=(--keep-workdir)
timeout "$seconds" python3 perf/streamed_vs_stored.py --gpu --target "$target" --workdir "$work" \
  --windows 1 --runs "$runs" "${keep[@]}" --out "$out/streamed-vs-stored-gpu-$runs.json" \
  >"$out/$runs.log" 2>&1
echo "rc $?"
tail -c 3000 "$out/$runs.log"
