"""One attention case, for a profiler: stof-cc's kernel (the model's choice, or a pinned point), cuDNN's
and FA4's (causal masks; cuDNN through SDPA, FA4 where it imports), each launched once inside a CUDA
profiler range after warm-up.

    ncu --clock-control none --profile-from-start off --section WarpStateStats --section SourceCounters \\
        -o attn python benchmarks/profile_attention.py causal:512:128
    ncu -i attn.ncu-rep --page source --csv --print-source sass --launch-count 1 > stof.csv
    python benchmarks/ncu_stalls.py stof.csv

CASE is mask:S:D as in `ab_attention.py` (D = 64: fp16, H = 12; D = 128: bf16, H = 16; B = 4096 // S,
8 up to S = 512; ``--batch`` sets another B). ``--params`` pins a point (JSON, e.g. ``'{"strategy": "wgmma_ws", "block_m": 128,
"block_n": 128, "warps": 8, "m_tiles": 1, "stages": 2, "persistent": true}'``); ``--no-peer`` leaves
the peers out. Every output is checked against the fp32 reference first. The session that wrote this
(benchmarks/history/20-2026-11-27.md) found with its scratch predecessor where the short causal tiles
wait; this committed form has not run on a GPU yet (the session's device time was spent).
Needs an NVIDIA GPU, PyCUDA and nvcc.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from ab_attention import case_inputs  # noqa: E402
from mha import fa4_available, fa4_peer, under  # noqa: E402

from stof_cc import attention  # noqa: E402
from stof_cc.ir.reference import masked_attention, relative_error  # noqa: E402
from stof_cc.templates.attention import config_label, problem_of  # noqa: E402
from stof_cc.tune.attention import launched_choice  # noqa: E402

TOLERANCE = 1e-2


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("case", help="mask:S:D, e.g. causal:512:128")
    parser.add_argument("--params", help="a point to pin, as JSON (default: the model's choice)")
    parser.add_argument("--no-peer", action="store_true", help="profile stof-cc's kernel alone")
    parser.add_argument("--batch", type=int, help="B (default: the grid's, 4096 // S, 8 up to S = 512)")
    args = parser.parse_args()
    name, seq, desc, (q, k, v) = case_inputs(args.case, args.batch)
    params = json.loads(args.params) if args.params else None
    label = config_label(params or launched_choice(problem_of(q, k, v), desc)[1].params)  # a dilated window's: its residues'
    runs = {f"stof-cc {label}": lambda: attention(q, k, v, desc, params=params)}
    if not args.no_peer and name == "causal":
        from torch.nn.attention import SDPBackend

        cudnn = under(SDPBackend.CUDNN_ATTENTION, is_causal=True)
        runs["cuDNN causal"] = lambda: cudnn(q, k, v)
        if fa4_available():
            fa4 = fa4_peer(causal=True)
            runs["FA4 causal"] = lambda: fa4(q, k, v)
    reference = masked_attention(q, k, v, desc.to_dense(seq, seq).cuda()).float()
    for what, run in runs.items():
        error = relative_error(run().float(), reference)
        print(f"{what}: relative error {error:.2e}")
        if not error < TOLERANCE:
            print(f"{what} is wrong: not profiled")
            return 1
        for _ in range(3):
            run()
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStart()
    for run in runs.values():
        run()
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
