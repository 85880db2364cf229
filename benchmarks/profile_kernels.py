"""Hardware counters for the kernels whose speed targets are missed, in one call.

Usage on the H200 (repository root)::

    PYTHONPATH=. python benchmarks/profile_kernels.py            # runs ncu on itself
    PYTHONPATH=. python benchmarks/profile_kernels.py --set train  # the training step's kernels
    PYTHONPATH=. python benchmarks/profile_kernels.py --set all    # both

The parent process re-runs this script under Nsight Compute (``ncu
--clock-control none --profile-from-start off``; the clocks are left alone,
as the device notes ask). The child builds the W1-16k inputs, warms every
kernel up, and opens the profiler window only around one call of each:

* dense -> TwELL construction (T 256, S 32), default tuning;
* ``TwELL @ W`` (``h @ w_down``), best tuning of ``benchmarks/kernels.py``;
* the dense cuBLAS product of the same shape (the baseline);
* a 1 GiB device copy (the bandwidth ceiling);
* one fused gated FFN call at W1-16k in sparse mode (gate GEMM, pack, sparse step).

It prints, per kernel: duration, DRAM / L2 / L1 / SM throughput as a
percentage of peak, L2 and L1 hit rates, achieved occupancy, registers per
thread, and the two largest warp-stall reasons; the raw CSV goes to
``$OUT/ncu_raw.csv``. The point is a measured cause for each gap
(memory-bound at X% of DRAM peak, or latency-bound at low occupancy, or
issue-bound), not a guess.
"""
# twellpy-bench: suite gpu-only
from __future__ import annotations

import csv
import io
import os
import shutil
import subprocess
import sys

SECTIONS = ("SpeedOfLight", "MemoryWorkloadAnalysis", "Occupancy", "LaunchStats", "WarpStateStats",
            "SchedulerStats")

# (column label, raw metric name); the raw page lists every metric the sections collected
COLUMNS = (
    ("us", "gpu__time_duration.sum"),
    ("DRAM %", "dram__throughput.avg.pct_of_peak_sustained_elapsed"),
    ("mem %", "gpu__compute_memory_throughput.avg.pct_of_peak_sustained_elapsed"),
    ("L2 %", "lts__throughput.avg.pct_of_peak_sustained_elapsed"),
    ("L1 %", "l1tex__throughput.avg.pct_of_peak_sustained_active"),
    ("SM %", "sm__throughput.avg.pct_of_peak_sustained_elapsed"),
    ("issue %", "smsp__issue_active.avg.pct_of_peak_sustained_active"),
    ("L2 hit", "lts__t_sector_hit_rate.pct"),
    ("L1 hit", "l1tex__t_sector_hit_rate.pct"),
    ("occ %", "sm__warps_active.avg.pct_of_peak_sustained_active"),
    ("regs", "launch__registers_per_thread"),
)
STALL_PREFIX, STALL_SUFFIX = "smsp__average_warps_issue_stalled_", "_per_issue_active.ratio"


def train_steps():
    """The W1-16k training step's kernels (bf16, the library's defaults): one forward, one backward."""
    from benchmarks.train import L1, train_inputs
    from twellpy import ffn as T

    x, wg, wu, wd, dy = train_inputs("W1-16k")
    state = {}

    def forward():
        state["ctx"] = T.gated_forward_train(x, wg, wu, wd, l1=L1, check_finite=False)[1]

    return [("train W1-16k forward", forward),
            ("train W1-16k backward", lambda: T.gated_backward(state["ctx"], dy))]


def child(which="infer"):
    import cupy as cp
    import numpy as np

    from benchmarks.kernels import dense_matmul_bf16, make_hidden
    from benchmarks.workloads import WORKLOADS, make_ffn
    from twellpy._array import bfloat16
    from twellpy.backends import cuda as tc
    from twellpy.ffn import GatedFFN

    spec = WORKLOADS["W1-16k"]
    h32, w32, _ = make_hidden(cp, spec)
    hb, wb = tc.astype(h32, bfloat16), tc.astype(w32, bfloat16)
    del h32, w32
    vals, idx, counts, _ = tc.dense_to_twell(hb, 256, 32)
    label, dense_fn = dense_matmul_bf16(cp, hb, wb)
    n_bytes = 1 << 30
    src, dst = cp.ones(n_bytes, cp.uint8), cp.empty(n_bytes, cp.uint8)
    w = make_ffn(**spec, dtype=bfloat16, xp=cp, seed=1)
    ffn = GatedFFN(w["w_gate"], w["w_up"], w["w_down"], mode="sparse", check_finite=False)

    def spmm_warp_per_row():
        saved = tc.SPMM_MAX_ITERS, tc.SPMM_DEFINES, tc.SPMM_ROW_BLOCK
        tc.SPMM_MAX_ITERS, tc.SPMM_DEFINES, tc.SPMM_ROW_BLOCK = 4, {"SPMM_LOADS": 8}, False
        try:
            return tc.twell_spmm(vals, idx, counts, wb)
        finally:
            tc.SPMM_MAX_ITERS, tc.SPMM_DEFINES, tc.SPMM_ROW_BLOCK = saved

    steps = [] if which == "train" else [("dense->TwELL", lambda: tc.dense_to_twell(hb, 256, 32)),
             ("TwELL @ W (row-block, default)", lambda: tc.twell_spmm(vals, idx, counts, wb)),
             ("TwELL @ W (warp-per-row)", spmm_warp_per_row),
             (f"dense {label}", dense_fn),
             ("copy 1 GiB", lambda: dst.data.copy_from_device_async(src.data, n_bytes)),
             ("FFN W1-16k sparse", lambda: ffn(w["x"]))]
    if which in ("train", "all"):
        steps += train_steps()
    for _, fn in steps:  # compile, plan and warm every kernel outside the window
        fn(), fn()
    cp.cuda.Device().synchronize()
    for name, fn in steps:
        print(f"## step {name}", flush=True)
        cp.cuda.runtime.profilerStart()
        fn()
        cp.cuda.Device().synchronize()
        cp.cuda.runtime.profilerStop()
    print("## steps:", ", ".join(n for n, _ in steps), np.__version__)


def _number(text):
    try:
        return float(text.replace(",", ""))
    except (AttributeError, ValueError):
        return None


def summarize(text):
    """Per-kernel table from ncu's ``--csv --page raw`` output (header, units, one row per kernel)."""
    start = text.find('"ID"')
    table = list(csv.reader(io.StringIO(text[start:]))) if start >= 0 else []
    if len(table) < 3:
        return "no kernel rows in the ncu output"
    header, units, rows = table[0], table[1], table[2:]
    col = {name: i for i, name in enumerate(header)}
    lines = ["kernel".ljust(36) + "".join(c.rjust(9) for c, _ in COLUMNS) + "  top stalls (warps per issue)"]
    for r in rows:
        cells = []
        for label, metric in COLUMNS:
            i = col.get(metric)
            v = _number(r[i]) if i is not None and i < len(r) else None
            if v is not None and metric == "gpu__time_duration.sum":
                v /= {"nsecond": 1e3, "ns": 1e3, "usecond": 1.0, "us": 1.0, "msecond": 1e-3,
                      "ms": 1e-3}.get(units[i], 1.0)
            cells.append(("-" if v is None else f"{v:.1f}").rjust(9))
        stalls = sorted(((_number(r[i]) or 0.0, name[len(STALL_PREFIX):-len(STALL_SUFFIX)])
                         for name, i in col.items()
                         if name.startswith(STALL_PREFIX) and name.endswith(STALL_SUFFIX) and i < len(r)),
                        reverse=True)[:3]
        kname = r[col["Kernel Name"]] if "Kernel Name" in col else "?"
        kname = kname.split("(")[0].split("<")[0].removeprefix("void ")[-35:]
        lines.append(kname.ljust(36) + "".join(cells) + "  " +
                     ", ".join(f"{n} {v:.2f}" for v, n in stalls))
    return "\n".join(lines)


def parent():
    out = os.environ.get("OUT", ".")
    ncu = shutil.which("ncu") or "/opt/nvidia/nsight-compute/ncu"
    cmd = [ncu, "--clock-control", "none", "--profile-from-start", "off", "--csv", "--page", "raw",
           "--print-units", "base"]
    for s in SECTIONS:
        cmd += ["--section", s]
    cmd += [sys.executable, os.path.abspath(__file__), "--child", *sys.argv[1:]]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=dict(os.environ, TWELLPY_PROFILE_CHILD="1"))
    with open(os.path.join(out, "ncu_raw.csv"), "w") as f:
        f.write(proc.stdout)
    with open(os.path.join(out, "ncu_stderr.txt"), "w") as f:
        f.write(proc.stderr)
    steps = [line for line in proc.stdout.splitlines() if line.startswith("## ")]
    print("\n".join(steps))
    if proc.returncode != 0:
        print(f"ncu exit {proc.returncode}; stderr tail:\n{proc.stderr[-3000:]}")
    print(summarize(proc.stdout))
    return proc.returncode


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    which = sys.argv[sys.argv.index("--set") + 1] if "--set" in sys.argv else "infer"
    if which not in ("infer", "train", "all"):
        sys.exit(f"--set must be infer, train or all, not {which!r}")
    if "--child" in sys.argv:
        child(which)
    else:
        sys.exit(parent())
