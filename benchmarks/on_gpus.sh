#!/usr/bin/env bash
# Run benchmark commands spread over the visible GPUs: command i goes to GPU i mod G, each GPU runs
# its share one after another (CUDA_VISIBLE_DEVICES set to that GPU), the GPUs in parallel. On a
# lent machine with two GPUs this is twice the measurements per call; each command is timed
# alone on its GPU, so its figures are as good as a run on a one-GPU machine.
#
#     bash benchmarks/on_gpus.sh LOGS "python3 benchmarks/gemm.py --m 4096" "python3 benchmarks/memory_bound.py" ...
#
# Command i's output goes to LOGS/i.log (stdout and stderr), its exit status to the log's last
# line; STOF_CC_CACHE, if set, gets a subfolder per GPU (two processes compiling one kernel at once
# would both write its cache entry). LIMIT (seconds, optional) bounds each GPU's share
# (`timeout`); GPUS overrides the GPU count (default: torch's). The last TAIL (default 15) lines
# of each log are printed at the end, in command order.
set -u
logs=${1:?usage: on_gpus.sh LOGS COMMAND...}
shift
mkdir -p "$logs"
gpus=${GPUS:-$(python3 -c 'import torch; print(max(1, torch.cuda.device_count()))')}
commands=("$@")
share() {  # run GPU $1's commands in order
  local gpu=$1 i
  for ((i = gpu; i < ${#commands[@]}; i += gpus)); do
    (export CUDA_VISIBLE_DEVICES=$gpu
     [ -n "${STOF_CC_CACHE:-}" ] && export STOF_CC_CACHE=$STOF_CC_CACHE/gpu$gpu
     bash -c "${commands[$i]}"; echo "exit status $?") >"$logs/$i.log" 2>&1
  done
}
for ((g = 0; g < gpus; g++)); do
  if [ -n "${LIMIT:-}" ]; then
    export -f share; export gpus logs
    timeout "$LIMIT" bash -c "commands=(\"\$@\"); share $g" _ "${commands[@]}" &
  else
    share "$g" &
  fi
done
wait
for ((i = 0; i < ${#commands[@]}; i++)); do
  echo "== $i (GPU $((i % gpus))): ${commands[$i]}"
  if [ ! -f "$logs/$i.log" ]; then echo "(not run: its GPU's share ran out of time before it)"; continue; fi
  tail -n "${TAIL:-15}" "$logs/$i.log"
  grep -q "^exit status" "$logs/$i.log" || echo "(stopped: its GPU's share ran out of time)"
done
