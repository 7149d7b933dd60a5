#!/usr/bin/env bash
# The runs of the several-GPU issues in one go, on every visible GPU (at least two): the GPU tests
# that need two GPUs, context-parallel attention (benchmarks/context_parallel.py) and tensor
# parallelism (examples/tensor_parallel.py), each on 2 GPUs and, where there are 4 or more, on 4;
# with four, also issue 38's longer rows: TP at S = 16384 on 2 and 4, CP at S = 524288 on 4, and
# data parallel (examples/multi_gpu.py) on all of them.
# Each run is bounded by LIMIT seconds (default 240; the S = 16384 and 524288 runs by LONG_LIMIT, default 500:
# each rank compiles and tunes its own shapes); output is unbuffered, so a run cut by its limit keeps what it
# printed; logs go to LOGS (default several-gpu-logs/);
# ONLY, if set, names the runs to make (tests cp2 tp2 cp4 tp4 tp2_16k tp4_16k cp4_512k dp); the
# tables and errors are printed last.
#
#     bash benchmarks/several_gpus.sh [LOGS]
set -u
cd "$(dirname "$0")/.."
logs=${1:-several-gpu-logs}
limit=${LIMIT:-240}
long_limit=${LONG_LIMIT:-500}
export PYTHONUNBUFFERED=1
mkdir -p "$logs"
gpus=$(python3 -c 'import torch; print(torch.cuda.device_count())')
if [ "$gpus" -lt 2 ]; then echo "several_gpus.sh needs two GPUs or more (torch sees $gpus)" >&2; exit 2; fi
port=29700
wanted() { [ -z "${ONLY:-}" ] || [[ " $ONLY " == *" $1 "* ]]; }
run() {  # run NAME NPROC SCRIPT ARGS...: torchrun on the first NPROC GPUs
  local name=$1 nproc=$2; shift 2
  wanted "$name" || return 0
  made+=("$name")
  port=$((port + 1))
  local bound=$limit
  [[ "$*" == *"--seq 16384"* || "$*" == *"--seq 524288"* ]] && bound=$long_limit
  timeout "$bound" torchrun --nproc-per-node "$nproc" --master-port "$port" "$@" >"$logs/$name.log" 2>&1
  echo "exit status $?" >>"$logs/$name.log"
}
made=()
if wanted tests; then
  made+=(tests)
  timeout "$limit" python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_tensor_parallel.py \
    tests/test_context_parallel.py tests/test_devices.py >"$logs/tests.log" 2>&1
  echo "exit status $?" >>"$logs/tests.log"
fi
run cp2 2 benchmarks/context_parallel.py
run tp2 2 examples/tensor_parallel.py --profile
if [ "$gpus" -ge 4 ]; then
  run cp4 4 benchmarks/context_parallel.py
  run tp4 4 examples/tensor_parallel.py --profile
  run tp2_16k 2 examples/tensor_parallel.py --seq 16384
  run tp4_16k 4 examples/tensor_parallel.py --seq 16384
  run cp4_512k 4 benchmarks/context_parallel.py --seq 524288 --repeats 5
  run dp "$gpus" examples/multi_gpu.py
fi
for name in "${made[@]}"; do  # this run's logs only
  f="$logs/$name.log"
  echo "== $name"
  grep -E "^(FAILED|ERROR)|^E  |passed|failed|^\||context parallel|TP =|^rank|relative error|distance|tokens/s|Error|exit status" \
    "$f" | head -16
done
