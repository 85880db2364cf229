"""Time the training step at small ELL widths, where most rows are dense backup rows (one short device call).

``benchmarks/train.py --widths`` times the same rows inside its full run; this probe
times only, at one workload (W2 by default): torch's dense autograd step, twellpy's
step at the default width, and at each ``--widths`` value the step (unchecked and
with ``check_finite=True``), its extra peak memory and error, and, where the backup
rows' weight gradients took the GEMM route, the same step with them gathered.
Numbers go to ``$OUT/backup_route.json`` when ``$OUT`` is set.

Usage (device, repo root):
``PYTHONPATH=. python benchmarks/backup_route_probe.py [--workload W2] [--widths 48 1] [--reps 10]``
"""
# twellpy-bench: suite gpu-only
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.train import (L1, WORKLOADS, cupy_extra_peak_mb, time_ms, time_widths, to_torch,  # noqa: E402
                              torch_dense_step, torch_extra_peak_mb, train_inputs, width_line)
from twellpy import _ffn_train as T  # noqa: E402


def main(argv=None):
    import cupy as cp
    import torch

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workload", default="W2", choices=sorted(WORKLOADS))
    ap.add_argument("--widths", nargs="+", default=["48", "1"])
    ap.add_argument("--reps", type=int, default=10)
    args = ap.parse_args(argv)
    x, wg, wu, wd, dy = train_inputs(args.workload)

    def fwd(width="auto", checked=False):
        return T.gated_forward_train(x, wg, wu, wd, l1=L1, check_finite=checked, width=width)

    def step(width="auto", checked=False):
        y, ctx = fwd(width, checked)
        return (y,) + T.gated_backward(ctx, dy)

    tt = [to_torch(a) for a in (x, wg, wu, wd, dy)]
    res = {"workload": args.workload, "torch_ms": time_ms(lambda: torch_dense_step(tt, torch.bfloat16), args.reps)}
    res["torch_extra_peak_MB"], outs = torch_extra_peak_mb(lambda: torch_dense_step(tt, torch.bfloat16))
    del outs
    torch.backends.cuda.matmul.allow_tf32 = False
    ref = torch_dense_step(tt, torch.float32)
    torch.cuda.empty_cache()
    step()  # compiles the kernels
    res["tw_ms"] = time_ms(step, args.reps)
    res["tw_extra_peak_MB"], outs = cupy_extra_peak_mb(step)
    del outs
    widths = [int(v) if v.isdigit() else v for v in args.widths]
    res["widths"] = time_widths(fwd, step, widths, args.reps, ref)
    dev = cp.cuda.runtime.getDeviceProperties(0)["name"].decode()
    res["device"] = dev
    print(json.dumps(res), flush=True)
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], "backup_route.json").write_text(json.dumps(res, indent=1))
    dense_ms, dense_mb = res["torch_ms"][0], res["torch_extra_peak_MB"]
    print(f"\ntraining step at small ELL widths, {args.workload}, bf16, {dev}")
    print(f"torch dense autograd {dense_ms:.3f} ms, extra memory {dense_mb:.0f} MB; twellpy default width "
          f"{res['tw_ms'][0]:.3f} ms ({dense_ms / res['tw_ms'][0]:.2f}x dense), extra memory "
          f"{res['tw_extra_peak_MB']:.0f} MB")
    for row in res["widths"]:
        print(f"width {row['width_arg']!s:>8}: " + width_line(row, dense_ms, dense_mb))


if __name__ == "__main__":
    main()
