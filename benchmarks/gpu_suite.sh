#!/usr/bin/env bash
# The GPU test suite (`pytest -m gpu`) split over the visible GPUs: each GPU runs its own share of
# the test files in its own process (CUDA_VISIBLE_DEVICES), then the tests that need every GPU
# (tests/test_devices.py, tests/test_tensor_parallel.py, context parallelism's two-GPU test) run once with all of them. With
# pytest-xdist installed each share runs WORKERS test processes on its GPU (default 8: the tests
# compile their kernels with nvcc, which the host's cores do in parallel). Logs go to LOGS
# (default: gpu-logs/); the last lines printed are each share's pytest summary, and
# LOGS/failures.txt holds every failure with its assertion lines (the whole logs can be too large
# to bring back from a lent machine).
#
#     bash benchmarks/gpu_suite.sh [LOGS] [WORKERS]
set -u
cd "$(dirname "$0")/.."
logs=${1:-gpu-logs}
workers=${2:-8}
mkdir -p "$logs"
parallel=""
python3 -c 'import xdist' 2>/dev/null && parallel="-n $workers"
gpus=$(python3 -c 'import torch; print(torch.cuda.device_count())')
files=$(python3 -m pytest --collect-only -q -m gpu tests/ 2>/dev/null | grep '::' | cut -d: -f1 \
        | grep -v -e test_devices.py -e test_tensor_parallel.py | sort | uniq -c | sort -rn | awk '{print $2}')
declare -a share
i=0
for f in $files; do  # the largest files first, dealt round-robin
  share[$((i % gpus))]+=" $f"
  i=$((i + 1))
done
pids=()
for g in $(seq 0 $((gpus - 1))); do
  [ -n "${share[$g]:-}" ] || continue
  CUDA_VISIBLE_DEVICES=$g python3 -m pytest -q -m gpu -p no:cacheprovider $parallel ${share[$g]} \
    >"$logs/gpu$g.log" 2>&1 &
  pids+=($!)
done
for p in "${pids[@]}"; do wait "$p"; done
python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_devices.py tests/test_tensor_parallel.py \
  tests/test_context_parallel.py::test_two_gpus_compute_what_one_gpu_does >"$logs/devices.log" 2>&1
for log in "$logs"/gpu*.log "$logs/devices.log"; do
  echo "== $log: $(grep -E '^(FAILED|ERROR)' "$log" | head -5 | tr '\n' ' ')"
  tail -1 "$log"
done
# every failure and its assertion lines in one small file (the logs can be too large to bring back)
for log in "$logs"/gpu*.log "$logs/devices.log"; do
  echo "== $log"; grep -E '^(FAILED|ERROR|E  )' "$log" | head -200
done > "$logs/failures.txt"
