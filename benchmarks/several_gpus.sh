#!/usr/bin/env bash
# The runs of the several-GPU issues in one go, on every visible GPU (at least two): the GPU tests
# that need two GPUs, context-parallel attention (benchmarks/context_parallel.py) and tensor
# parallelism (examples/tensor_parallel.py), each on 2 GPUs and, where there are 4 or more, on 4.
# Each run is bounded by LIMIT seconds (default 240); logs go to LOGS (default several-gpu-logs/);
# the tables and errors are printed last.
#
#     bash benchmarks/several_gpus.sh [LOGS]
set -u
cd "$(dirname "$0")/.."
logs=${1:-several-gpu-logs}
limit=${LIMIT:-240}
mkdir -p "$logs"
gpus=$(python3 -c 'import torch; print(torch.cuda.device_count())')
if [ "$gpus" -lt 2 ]; then echo "several_gpus.sh needs two GPUs or more (torch sees $gpus)" >&2; exit 2; fi
port=29700
run() {  # run NAME NPROC SCRIPT ARGS...: torchrun on the first NPROC GPUs
  local name=$1 nproc=$2; shift 2
  port=$((port + 1))
  timeout "$limit" torchrun --nproc-per-node "$nproc" --master-port "$port" "$@" >"$logs/$name.log" 2>&1
  echo "exit status $?" >>"$logs/$name.log"
}
timeout "$limit" python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_tensor_parallel.py \
  tests/test_context_parallel.py tests/test_devices.py >"$logs/tests.log" 2>&1
echo "exit status $?" >>"$logs/tests.log"
sizes=(2)
[ "$gpus" -ge 4 ] && sizes+=(4)
for n in "${sizes[@]}"; do
  run "cp$n" "$n" benchmarks/context_parallel.py
  run "tp$n" "$n" examples/tensor_parallel.py
done
echo "== tests"; grep -E "^(FAILED|ERROR)|^E  " "$logs/tests.log" | head -20; tail -2 "$logs/tests.log"
for n in "${sizes[@]}"; do
  echo "== context parallel, $n GPUs"; grep -E "^\||context parallel|Error|exit status" "$logs/cp$n.log" | head -12
  echo "== tensor parallel, $n GPUs"; grep -E "TP =|^rank|relative error|distance|Error|exit status" "$logs/tp$n.log" | head -12
done
