"""Time the training ELL kernels' row-loop variants alone (one device call, a few minutes).

``benchmarks/train.py`` times the same variants inside its full run (torch baselines,
speculation, split step); this probe times only the forward and backward of each
variant of :data:`benchmarks.train.ROW_VARIANTS` at one workload, checks that every
variant gives the first one's bits, and prints a table. Numbers go to
``$OUT/row_loops.json`` when ``$OUT`` is set.

Usage (device, repo root): ``PYTHONPATH=. python benchmarks/row_loops_probe.py [--workload W1-16k] [--reps 10]``
"""
# twellpy-bench: suite gpu-only
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.train import L1, WORKLOADS, time_row_variants, train_inputs  # noqa: E402
from twellpy import _ffn_train as T  # noqa: E402


def main(argv=None):
    import cupy as cp

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workload", default="W1-16k", choices=sorted(WORKLOADS))
    ap.add_argument("--reps", type=int, default=10)
    args = ap.parse_args(argv)
    x, wg, wu, wd, dy = train_inputs(args.workload)
    fwd = lambda: T.gated_forward_train(x, wg, wu, wd, l1=L1, check_finite=False)  # noqa: E731
    rows = time_row_variants(fwd, dy, args.reps, on_row=lambda row: print(json.dumps(row), flush=True))
    dev = cp.cuda.runtime.getDeviceProperties(0)["name"].decode()
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], "row_loops.json").write_text(json.dumps({"device": dev, "workload": args.workload,
                                                                          "rows": rows}, indent=1))
    ref = rows[0]
    print(f"\nrow loops of the training ELL kernels, {args.workload}, bf16, {dev}")
    print(f"{'variant':20} {'fwd ms':>8} {'bwd ms':>8} {'fwd+bwd':>8} {'vs ' + ref['variant']:>16} same bits")
    for r in rows:
        tot = r["fwd_ms"][0] + r["bwd_ms"][0]
        print(f"{r['variant']:20} {r['fwd_ms'][0]:8.3f} {r['bwd_ms'][0]:8.3f} {tot:8.3f} "
              f"{(ref['fwd_ms'][0] + ref['bwd_ms'][0]) / tot:15.3f}x {r['same_bits']}")


if __name__ == "__main__":
    main()
