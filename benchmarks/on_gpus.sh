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
# (`timeout`); GPUS overrides the GPU count (default: torch's, else nvidia-smi's, else 1); the
# caller's CUDA_VISIBLE_DEVICES, if set, is the list the GPUs are taken from. The last TAIL
# (default 15) lines of each log are printed at the end, in command order; the exit status is 1
# when a command failed, was stopped or did not run. The host's CPUs are shared: a figure that
# counts host work (a mask built per call) is not a one-GPU machine's.
set -u
logs=${1:?usage: on_gpus.sh LOGS COMMAND...}
shift
mkdir -p "$logs"
rm -f "$logs"/[0-9]*.log  # a reused folder: no earlier run's log stands in for a command that did not run
visible=()
if [ -n "${CUDA_VISIBLE_DEVICES:-}" ]; then IFS=, read -r -a visible <<<"$CUDA_VISIBLE_DEVICES"; fi
gpus=${GPUS:-$(python3 -c 'import torch; print(torch.cuda.device_count())' 2>/dev/null \
               || nvidia-smi -L 2>/dev/null | wc -l)}
[ "${gpus:-0}" -ge 1 ] 2>/dev/null || gpus=1
commands=("$@")
share() {  # run GPU $1's commands in order
  local gpu=$1 i device
  device=${visible[$gpu]:-$gpu}
  for ((i = gpu; i < ${#commands[@]}; i += gpus)); do
    (export CUDA_VISIBLE_DEVICES=$device
     [ -n "${STOF_CC_CACHE:-}" ] && export STOF_CC_CACHE=$STOF_CC_CACHE/gpu$gpu
     bash -c "${commands[$i]}"; echo "exit status $?") >"$logs/$i.log" 2>&1
  done
}
for ((g = 0; g < gpus; g++)); do
  if [ -n "${LIMIT:-}" ]; then
    export -f share; export gpus logs
    timeout "$LIMIT" bash -c "visible=(${visible[*]:-}); commands=(\"\$@\"); share $g" _ "${commands[@]}" &
  else
    share "$g" &
  fi
done
wait
status=0
for ((i = 0; i < ${#commands[@]}; i++)); do
  echo "== $i (GPU $((i % gpus))): ${commands[$i]}"
  if [ ! -f "$logs/$i.log" ]; then echo "(not run: its GPU's share ran out of time before it)"; status=1; continue; fi
  tail -n "${TAIL:-15}" "$logs/$i.log"
  last=$(tail -n 1 "$logs/$i.log")
  if [ "${last#exit status }" = "$last" ]; then echo "(stopped: its GPU's share ran out of time)"; status=1
  elif [ "$last" != "exit status 0" ]; then status=1; fi
done
exit $status
